from layered_cache.cli import main

raise SystemExit(main())
