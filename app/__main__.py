"""`python -m app` is the `inf2serve` command."""

from app.cli import main

raise SystemExit(main())
