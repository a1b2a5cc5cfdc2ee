"""The `freetoken` command line: one module per command, registered here.

Commands import torch and the runtime inside their bodies, so `freetoken --help` stays fast.
`main()` turns a FreetokenError into one line on stderr and exit code 1; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import sys

import typer

from freetoken.cli.bench import bench
from freetoken.cli.convert import convert
from freetoken.cli.experts_profile import experts_profile
from freetoken.cli.generate import generate
from freetoken.cli.inspect import inspect
from freetoken.cli.parity import parity
from freetoken.errors import FreetokenError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _root() -> None:
    """Unified Qwen-family checkpoints and offline batch generation with lossless speculative decoding."""


app.command()(convert)
app.command()(inspect)
app.command()(generate)
app.command()(parity)
app.command()(bench)
app.command("experts-profile")(experts_profile)


def main() -> None:
    try:
        app(standalone_mode=False)
    except FreetokenError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # click usage errors arrive here in non-standalone mode
        if isinstance(exc, _click_exception()):
            exc.show()
            sys.exit(exc.exit_code)
        if isinstance(exc, typer.Abort):
            sys.exit(1)
        raise


def _click_exception() -> type[Exception]:
    """The usage errors' base class of the click that typer runs on: the click package, or the copy
    that typer >= 0.29 carries inside itself (typer._click), which the click package's class misses."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
