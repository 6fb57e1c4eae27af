import sys

from dstest.cli import main

sys.exit(main())
