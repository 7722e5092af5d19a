"""``python -m stoker``: the CLI, also as torchrun launches it (``torchrun -m stoker train``)."""

import sys

from stoker.cli.main import main

sys.exit(main())
