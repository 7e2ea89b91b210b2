from bidir_kv.cli import main

raise SystemExit(main())
