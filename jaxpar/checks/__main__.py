"""`python -m jaxpar.checks`: the rules, one a line; `--markdown`: docs/config_checks.md."""

import argparse

from jaxpar.checks import CATALOGUE
from jaxpar.checks.docs import markdown

parser = argparse.ArgumentParser(prog="python -m jaxpar.checks", description=__doc__)
parser.add_argument("--markdown", action="store_true", help="print the docs page (docs/config_checks.md)")
if parser.parse_args().markdown:
    print(markdown(), end="")
else:
    for rule in CATALOGUE:
        print(f"{rule.id:40s} {rule.summary}")
