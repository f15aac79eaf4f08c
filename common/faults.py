"""The faults a process meets by no fault of its code, each said in one line with what to do.

Another process or the store lost, a collective timed out, a DataLoader worker killed, no memory:
common.failures' watch says the line of the one it meets, instead of a traceback."""

import re

import torch

from common.errors import first_line


def fault_line(me: str, error: BaseException) -> str | None:
    """The line for a fault that this process ``me`` met by no fault of its code, or None: another
    process or the store lost, a collective timed out, a DataLoader worker killed, no memory."""
    said = " ".join(str(e) for e in (error, error.__cause__, error.__context__) if e)
    worker = re.search(r"DataLoader worker \(pid (\d+)\) is killed by signal: (\w+)", said) or \
        re.search(r"DataLoader worker \(pid\(s\) ([\d, ]+)\) exited unexpectedly()", said)
    if lost_a_process(error):
        return (f"error: process {me} lost another process of the job in a collective "
                f"({_short(error)}): that process ended first; its own output or the "
                f"launcher's report says why")
    if isinstance(error, (torch.distributed.DistNetworkError, torch.distributed.DistStoreError)):
        return lost_the_store(me, error)
    if _timed_out(error):
        return (f"error: process {me} waited --dist-timeout in a collective for another process "
                f"that never came ({_short(error)}): it stalled (a hung read, a stopped process) "
                f"or is far slower; raise --dist-timeout only for the second")
    if worker:
        return (f"error: process {me}: its DataLoader worker (pid {worker[1]}) "
                f"{f'was killed ({worker[2]})' if worker[2] else 'ended'}, as the kernel kills a "
                f"process when memory runs out: give the job more memory, or pass fewer --workers; "
                f"then the same command with --resume continues from the last checkpoint")
    if isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in said:
        return (f"error: process {me} ran out of memory ({first_line(error)}): pass a smaller "
                f"--batch-size (with --grad-accum N to keep the global batch), or --compile none "
                f"(CUDA graphs hold memory of their own); then the same command with --resume "
                f"continues from the last checkpoint")
    return None


def lost_the_store(me: str, error: BaseException) -> str:
    return (f"error: process {me} lost the store through which the job's processes meet "
            f"({first_line(error)}): its host (process 0, or the launcher) ended or stopped, so "
            f"the job is failing; that process's output or the launcher's report says why")


def lost_a_process(error: BaseException) -> bool:
    """Whether ``error`` is a collective's failure because another process is gone."""
    return re.search(r"Connection closed by peer|Connection reset by peer|Broken pipe|"
                     r"remote process exited|NCCL error", str(error)) is not None


def _timed_out(error: BaseException) -> bool:
    """Whether ``error`` is a collective that waited out --dist-timeout (gloo's, NCCL's words)."""
    return re.search(r"Timed out waiting \d+ms|collective operation timeout|timed out after",
                     str(error)) is not None


def _short(error: BaseException) -> str:
    """A collective's error in a few words: gloo's starts with the source file and goes on."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0])
    return text.split(". ", 1)[0]
