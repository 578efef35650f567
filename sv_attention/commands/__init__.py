"""One module per ``sv-attention`` subcommand (see :mod:`sv_attention.cli`)."""
