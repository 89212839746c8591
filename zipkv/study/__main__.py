"""``python -m zipkv.study``: zipkv's command line with the study's commands, from a checkout that is not installed
(``python -m zipkv`` finds them through the installed package's entry points)."""
import sys

from zipkv.__main__ import main
from zipkv.study import cli

sys.exit(main(extensions=[cli]))
