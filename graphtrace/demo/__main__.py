"""`python -m graphtrace.demo` runs the demo (same as `graphtrace demo`)."""

from graphtrace.demo.runner import main

raise SystemExit(main())
