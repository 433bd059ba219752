"""`python -m edgetrain` runs the edgetrain command."""

from edgetrain.cli import main

raise SystemExit(main())
