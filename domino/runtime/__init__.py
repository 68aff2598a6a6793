"""The distributed runtime: process groups (:mod:`~domino.runtime.state`), decisions all ranks take together
(:mod:`~domino.runtime.agreement`), the emulated interconnect (:mod:`~domino.runtime.network_emulator`) and the
host time blocked in collectives (:mod:`~domino.runtime.comm_timing`).

What the ranks *are* and how long they wait lives here; what they compute together (the tensor-parallel maths)
lives in :mod:`domino.parallel`.
"""
