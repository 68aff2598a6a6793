"""``python -m domino`` (and ``torchrun -m domino``) runs the ``domino`` command line."""

from domino.cli.main import main

if __name__ == "__main__":
    main()
