from balanced_loader.cli import main

raise SystemExit(main())
