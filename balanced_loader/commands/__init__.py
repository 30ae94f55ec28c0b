"""One module per ``balanced-loader`` subcommand: ``add_arguments(parser)`` and ``run(args)``."""
