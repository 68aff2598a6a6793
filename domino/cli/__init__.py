"""The ``domino`` command line: one thin module per verb group, no logic of its own.

``domino`` builds every verb's parser at start-up, so a verb module imports at its top only what is light
(argparse, configs, the launcher); the verb's implementation, where it pulls in torch, DeepSpeed, numpy,
tokenizers, matplotlib or kfp, is imported inside the function that runs the verb. That is the one reason
for the function-local imports of this package: ``domino launch``, ``domino estimate`` and ``--help`` start
without them (tests/pipelines/test_pipeline_params.py checks kfp).
"""
