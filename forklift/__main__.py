import sys

from forklift.cli import main

sys.exit(main())
