import sys

from onnxmerge.cli import main

sys.exit(main())
