"""`python -m graphtrace` is the `graphtrace` command."""

from graphtrace.cli import main

raise SystemExit(main())
