import sys

from linnet_jax.cli import main

sys.exit(main())
