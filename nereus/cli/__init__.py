"""The `nereus` command line: a thin typer veneer over the library."""
