"""What every launch command does with a user's mistake: one line on stderr naming the problem, a non-zero exit,
no traceback. A bug (any other exception) still shows its traceback.

    @user_errors("launch.generate")          argparse commands: wraps main(argv)
    def main(argv=None): ap = ArgumentParser(...)
    with flag_errors("launch.train"):        absl / ml_collections commands (train, evaluate): around the
        config_flags.DEFINE_config_file(...)   config flag's definition (it reads the overrides)
    run_absl("launch.train", main)           and instead of app.run(main)

Errors are recognised by class name (no imports: the supervisor must not load jax)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys

# the project's user-facing error classes (and their subclasses)
USER_ERRORS = frozenset({"ConfigError", "DataError", "CheckpointError", "TrainConfigError", "ZayaCheckpointError",
                         "GroupError", "HardwareError", "UsageError", "MeshError", "ContextParallelError"})
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # the shell's code for a command ended by SIGINT


class UsageError(ValueError):
    """A command's own check of its arguments failed."""


def quiet_checkpoint_reads() -> None:
    """Orbax's absl warnings on every read-only restore (read_only=True settings, missing metadata files) are noise
    for commands that only read checkpoints."""
    from absl import logging
    logging.set_verbosity(logging.ERROR)


def is_user_error(e: BaseException) -> bool:
    return any(c.__name__ in USER_ERRORS for c in type(e).__mro__)


def one_line(e) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def fail(name: str, message: str):
    print(f"{name}: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USER_ERROR)


def user_errors(name: str):
    def wrap(main):
        @functools.wraps(main)
        def guarded(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except KeyboardInterrupt:  # Ctrl-C: what the command opened was closed on the way out
                print(f"{name}: interrupted", file=sys.stderr)
                raise SystemExit(EXIT_INTERRUPTED) from None
            except Exception as e:
                if not is_user_error(e):
                    raise
                fail(name, one_line(e))
        return guarded
    return wrap


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (the full usage stays under --help)."""

    def error(self, message):  # user_errors() prints it under the command's name
        raise UsageError(f"{message} (see --help)")


def _causes(e: BaseException):
    """e, then what it was raised from or during, down to the first error."""
    yield e
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
        yield e


def _root_cause(e: BaseException) -> BaseException:
    *_, root = _causes(e)
    return root


def _unknown_field(field: str, argv) -> str | None:
    """The message for a --config.PATH override through a key the config does not have (ml_collections raises a
    bare KeyError naming the key), or None if no override's path holds that key."""
    for arg in argv:
        keys = arg.split("=", 1)[0].removeprefix("--").split(".")
        if keys[0] == "config" and field in keys[1:]:
            path = ".".join(keys[1:keys.index(field, 1) + 1])
            hint = (" (model fields go under --config.model.overrides.FIELD)"
                    if keys[1] == "model" and path != "model.overrides" and not path.startswith("model.overrides.")
                    else "")
            return f"{arg}: the config has no field {path!r}{hint}"
    return None


@contextlib.contextmanager
def flag_errors(name: str, argv=None):
    """Anything raised while the command line is read is the command line's fault: one line. ml_collections reads
    --config.x overrides already when the config flag is defined, and loads the config file lazily."""
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except Exception as e:
        user = next((x for x in _causes(e) if is_user_error(x)), None)
        if user is not None:  # e.g. a damaged run record read for a resume: its own message says what is wrong
            fail(name, one_line(user))
        root = _root_cause(e)
        if isinstance(root, OSError):  # a config file that did not load: its last line names the reason
            message = str(root).strip().splitlines()[-1]
        else:
            message = e
            while isinstance(message, BaseException) and len(message.args) == 1:  # KeyError('...') in AttributeError
                message = message.args[0]
            if isinstance(root, KeyError) and root.args and isinstance(root.args[0], str):
                message = _unknown_field(root.args[0].strip("'"), sys.argv if argv is None else argv) or message
        fail(name, f"bad command line: {one_line(message)}")


def run_absl(name: str, main, argv=None):
    """app.run(main) with flag errors (absl's, a config file that does not load) as one line."""
    from absl import app, flags

    def parse(argv):
        with flag_errors(name, argv):
            rest = flags.FLAGS(argv)
            if "config" in flags.FLAGS:
                getattr(flags.FLAGS["config"].value, "keys", None)  # raises here if the config file did not load
            return rest

    user_errors(name)(lambda: app.run(main, argv=sys.argv if argv is None else argv, flags_parser=parse))()
