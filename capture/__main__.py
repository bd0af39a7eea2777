from capture._cli import main

raise SystemExit(main())
