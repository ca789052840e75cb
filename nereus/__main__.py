"""`python -m nereus`: the same CLI as the `nereus` console script."""

from nereus.cli.app import main

main()
