"""Launchers: the gin-configured command-line programs (T5X conventions: --gin_file,
--gin.NAME=VALUE, --gin_search_paths). Each module's `main` is a console entry point
(pyproject.toml) and scripts/ keeps a thin wrapper of each. This is the edge layer:
only here is gin parsed; the library below never imports launch."""
