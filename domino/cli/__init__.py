"""The ``domino`` command line: one thin module per verb group, no logic of its own."""
