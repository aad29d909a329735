"""The `portal` command."""


def main() -> None:
    raise SystemExit("portal: the CLI is being built; see docs/cli.md once it lands.")
