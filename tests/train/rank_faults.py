"""Runs ``domino`` as one rank of a torchrun job, with a fault of that rank's own (a test launcher).

torchrun starts ``python rank_faults.py pretrain ...`` for every rank; before handing over to the real
``domino`` command line, the rank named in the environment gets its fault:

* ``DOMINO_TEST_CWD_RANK<r>=DIR``: rank r works in DIR, so a relative ``--data-path`` names another file
  there (a node whose copy of the data differs);
* ``DOMINO_TEST_FSIZE_RANK<r>=BYTES``: rank r may not write files larger than BYTES (``RLIMIT_FSIZE``), as
  on a full disk. SIGXFSZ is ignored so the write fails with EFBIG ("File too large") instead of killing
  the process (setrlimit(2), signal(7)).
"""

import os
import resource
import signal
import sys

rank = os.environ.get("RANK", "0")
workdir = os.environ.get(f"DOMINO_TEST_CWD_RANK{rank}")
if workdir:
    os.chdir(workdir)
limit = os.environ.get(f"DOMINO_TEST_FSIZE_RANK{rank}")
if limit:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))

if __name__ == "__main__":
    from domino.cli.main import main

    sys.argv[0] = "domino"
    main()
