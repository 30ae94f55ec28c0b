"""Reproduce the published comparisons of FlexSP, HyDra and Hydraulis by the contract-2 cost model.

The tool lives in the package (``balanced_loader.cli.reproduce``, its docstring says what it does) so tests
import it like any module; this file keeps the documented command line.

    .venv/bin/python tools/reproduce.py [--settings flexsp,hydra,hydraulis] [--batches 5]
"""

import sys

from balanced_loader.cli.reproduce import main

if __name__ == "__main__":
    sys.exit(main())
