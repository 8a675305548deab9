"""``python -m contribution_lens.cli``."""

from contribution_lens.cli.app import main

raise SystemExit(main())
