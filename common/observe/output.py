"""Output that can fail without costing training: stdout and stderr that never raise.

A run's log lines go to a terminal, a pipe or a log collector. When that reader goes away (`... |
head`, a dead `tee`, a closed ssh session), the next print raises BrokenPipeError (or EIO on a hung
up terminal) wherever it happens, between a step and its checkpoint. The run's record does not
depend on them: metrics.jsonl, the checkpoints and wandb hold everything the log lines show.
"""

import io
import os
import sys
from contextlib import suppress


class _Unbreakable(io.TextIOBase):
    """A text stream that passes writes on until one fails, then sends the rest (and what the failed
    stream still buffers) to /dev/null: no later write or flush, at exit included, raises again."""

    def __init__(self, stream):
        self.stream, self.broken = stream, False

    def write(self, text: str) -> int:
        self._pass_on(self.stream.write, text)
        return len(text)

    def flush(self) -> None:
        self._pass_on(self.stream.flush)

    def _pass_on(self, call, *args) -> None:
        if self.broken:
            return
        try:
            call(*args)
        except OSError:
            self.broken = True
            with suppress(OSError, ValueError):  # so its flush at exit goes to /dev/null, no error
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self.stream.fileno())
                os.close(devnull)

    def fileno(self) -> int:
        return self.stream.fileno()

    # io.TextIOBase answers these itself (None, False): the stream's own answers, for tqdm and wandb
    encoding = property(lambda self: self.stream.encoding)
    errors = property(lambda self: self.stream.errors)

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return not self.broken and self.stream.isatty()

    def __getattr__(self, name):  # buffer, name, mode ...: those of the stream
        return getattr(self.stream, name)


def survive_closed_output() -> None:
    """Replace sys.stdout and sys.stderr by streams that never raise: a closed or broken output
    drops the rest of the lines and training goes on. Call it first thing in a training process."""
    for name in ("stdout", "stderr"):
        if (stream := getattr(sys, name)) is not None and not isinstance(stream, _Unbreakable):
            setattr(sys, name, _Unbreakable(stream))
