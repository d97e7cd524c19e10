"""One module per `kdaserve` subcommand; see kdaserve/cli.py."""
