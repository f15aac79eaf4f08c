"""Every call that all processes must make says so at the call, the same way in every script.

A collective (an all-reduce, a gather, a broadcast, a barrier, save_state) waits until every
process has made it: one put under `if accelerator.is_main_process:` hangs the job until
--dist-timeout, the first thing a DDP learner breaks. The training scripts mark each statement that
makes one, or calls a function that does, with a comment starting `# ALL` (`# ALL` alone or
`# ALL: why`) on one of its lines; the step inside `with accelerator.accumulate(model):` (forward
and backward: DDP's all-reduce, FSDP2's all-gather and reduce-scatter) is marked once, on the
`with` line.

COLLECTIVES lists the calls that make a statement collective, as the scripts write them, and
the list is checked against the code: a function of common/ (or of a script) is on it iff it calls
one of PRIMITIVES, or a function of common/ that does, as far as names resolve statically (calls
by name, ``self.method``, methods of objects the scripts build from a common/ class). Pure file
reading: no training, under a second.
"""

import ast
import io
import re
import textwrap
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["train_single", "train_dp", "train_ddp", "train_amp", "train_fsdp"]
MARK = re.compile(r"# ALL(:\s\S|$)")  # the comment starts with it: `# ALL`, `# ALL: why`
ONE_PROCESS = re.compile(r"\bis_(local_)?main_process\b|\bprocess_index\b|\brank\b")

# The calls that every process must make, as the scripts write them: functions of common/ by name,
# methods of common/ classes as Class.method, Accelerate's as accelerator.method, and the scripts'
# own functions that make one. Checked against the code below; the step (accumulate) is apart.
COLLECTIVES = {
    "lock_run_and_find_resume", "refused_together", "load_data", "resume_from", "start_run",
    "check_launch", "evaluate", "peak_memory", "save_final_weights", "announce_stop",
    "average_buffers", "gathered_model",
    "StepGuard.check", "StepGuard.signalled", "Checkpointer.save", "WeightAverage.update",
    "WeightAverage.evaluate", "ShardedWeightAverage.update", "ShardedWeightAverage.evaluate",
    "EpochMeter.figures",
    "Accelerator", "accelerator.prepare", "accelerator.reduce",
    "accelerator.backward", "accelerator.clip_grad_norm_",  # in the step, marked by its `with`
    "set_up", "make_model",  # the scripts' own
}
STEP = "accelerator.accumulate"  # its block is the step: forward and backward on every process

# What makes a collective without reading further. Accelerator() makes the process group (every
# process meets in init_process_group); under DDP prepare() broadcasts the main process's weights
# and backward() all-reduces the gradients; under FSDP2 clip_grad_norm_() all-reduces the norm and
# get_state_dict() all-gathers the shards; DTensor's full_tensor() all-gathers.
ACCELERATOR = {"prepare", "backward", "clip_grad_norm_", "reduce", "gather", "gather_for_metrics",
               "wait_for_everyone", "save_state", "load_state", "get_state_dict", "save_model"}
DISTRIBUTED = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
               "broadcast", "broadcast_object_list", "barrier", "reduce_scatter",
               "reduce_scatter_tensor", "gather_object", "scatter", "monitored_barrier"}
PRIMITIVES = {"Accelerator", "full_tensor", "distribute_tensor", *DISTRIBUTED,
              *(f"accelerator.{name}" for name in ACCELERATOR)}
COLLECTIVE_MODULES = ("torch.distributed", "accelerate.utils", "accelerate")


def _primitive(call: ast.Call, imported: dict[str, str]) -> bool:
    """Whether ``call`` is itself a collective; ``imported``: name -> the module it came from."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id in PRIMITIVES and imported.get(func.id, "").startswith(COLLECTIVE_MODULES)
    if not isinstance(func, ast.Attribute):
        return False
    receiver = ast.unparse(func.value)
    if receiver == "accelerator" or receiver.endswith(".accelerator"):
        return func.attr in ACCELERATOR
    return (receiver in ("dist", "torch.distributed") and func.attr in DISTRIBUTED
            or func.attr == "full_tensor")


def _imports(tree: ast.Module) -> dict[str, str]:
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.update({alias.asname or alias.name: node.module for alias in node.names})
        elif isinstance(node, ast.Import):
            found.update({alias.asname or alias.name: alias.name for alias in node.names})
    return found


class Code:
    """The functions and methods of some modules, and which of them reach a collective; a class's
    methods include those it inherits from a class of these modules."""

    def __init__(self, paths):
        self.functions, self.classes, self.imports, self.bases = {}, {}, {}, {}
        for path in paths:
            tree = ast.parse(path.read_text())
            imported = _imports(tree)
            for node in tree.body:
                if isinstance(node, ast.FunctionDef):
                    self.functions.setdefault(node.name, []).append((node, None, imported))
                elif isinstance(node, ast.ClassDef):
                    methods = {m.name: (m, imported) for m in node.body
                               if isinstance(m, ast.FunctionDef)}
                    self.classes[node.name] = methods
                    self.bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
        for cls in self.classes:
            for name, (method, imported) in self.methods(cls).items():
                self.functions.setdefault(f"{cls}.{name}", []).append((method, cls, imported))
        self.reaching = self._fixpoint()

    def methods(self, cls: str) -> dict:
        """``cls``'s methods, its own over those of its bases here, as Python looks them up."""
        found = {}
        for base in self.bases.get(cls, []):
            found.update(self.methods(base) if base in self.classes else {})
        return {**found, **self.classes[cls]}

    def callees(self, call: ast.Call, cls: str | None) -> list[str]:
        """The functions here that ``call`` may run: by name, a class's __init__, self.method."""
        func = call.func
        if isinstance(func, ast.Name):
            if func.id in self.classes:
                return [f"{func.id}.__init__"]
            return [func.id] if func.id in self.functions else []
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                and func.value.id == "self" and cls:
            return [f"{cls}.{func.attr}"]
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call) \
                and ast.unparse(func.value.func) == "super" and cls:  # super().method: the bases'
            return [f"{base}.{func.attr}" for base in self.bases.get(cls, [])]
        return []

    def _fixpoint(self) -> set[str]:
        reaching = set()
        while True:
            before = len(reaching)
            for name, defs in self.functions.items():
                for node, cls, imported in defs:
                    calls = [c for c in ast.walk(node) if isinstance(c, ast.Call)]
                    if any(_primitive(c, imported) or reaching & set(self.callees(c, cls))
                           for c in calls):
                        reaching.add(name)
            if len(reaching) == before:
                return reaching


COMMON = Code(sorted(p for p in (ROOT / "common").rglob("*.py") if "__pycache__" not in p.parts))


class Script:
    """A training script: its calls, each named as COLLECTIVES names them, and its `# ALL` lines."""

    def __init__(self, text: str):
        self.tree = ast.parse(text)
        self.imported = _imports(self.tree)
        self.own_functions = {n.name: n for n in self.tree.body if isinstance(n, ast.FunctionDef)}
        # objects the script builds from a common/ class: ``guard = StepGuard(...)``
        self.types = {target.id: node.value.func.id for node in ast.walk(self.tree)
                      if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                      and isinstance(node.value.func, ast.Name)
                      and node.value.func.id in COMMON.classes
                      for target in node.targets if isinstance(target, ast.Name)}
        tokens = tokenize.generate_tokens(io.StringIO(text).readline)
        self.marked = {token.start[0] for token in tokens
                       if token.type == tokenize.COMMENT and MARK.match(token.string)}
        self._reaching = {}

    def name(self, call: ast.Call) -> str | None:
        """``call``'s callee as COLLECTIVES writes it; None for what it does not name (a model's
        forward, torch's functions, methods of objects of unknown class)."""
        func = call.func
        if isinstance(func, ast.Name):
            return func.id
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            if owner == "accelerator":
                return f"accelerator.{func.attr}"
            if owner in self.types:
                return f"{self.types[owner]}.{func.attr}"
        return None

    def reaches(self, name: str | None) -> bool:
        """Whether the callee ``name`` makes a collective, read in the code."""
        if name is None:
            return False
        if name in PRIMITIVES:
            return name != "Accelerator" or self.imported.get(name) == "accelerate"
        if name in self.own_functions:
            if name not in self._reaching:
                self._reaching[name] = False  # recursion: not by itself
                self._reaching[name] = any(
                    self.reaches(self.name(c)) for c in ast.walk(self.own_functions[name])
                    if isinstance(c, ast.Call))
            return self._reaching[name]
        if name.startswith("accelerator."):
            return False
        if name in COMMON.classes:
            name = f"{name}.__init__"
        return name in COMMON.reaching

    def statements(self):
        """(first line, last line, calls, in the step, on one process) for each simple statement,
        and for each compound statement's header (a with's items, an if's test, a for's iterable);
        on one process: under an `if` that asks which process this is."""
        def walk(body, in_step, alone=False):
            for stmt in body:
                if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
                    yield from walk(stmt.body, in_step)
                    continue
                if isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "__name__ == '__main__'":
                    continue  # the script's entry: main() is all of it
                header = {ast.With: lambda s: [i.context_expr for i in s.items],
                          ast.If: lambda s: [s.test], ast.While: lambda s: [s.test],
                          ast.For: lambda s: [s.iter], ast.Try: lambda s: []}.get(type(stmt))
                parts = header(stmt) if header else [stmt]
                calls = [c for part in parts for c in ast.walk(part) if isinstance(c, ast.Call)]
                if parts:
                    yield (stmt.lineno, max(p.end_lineno for p in parts), calls, in_step, alone)
                step = any(self.name(c) == STEP for c in calls)
                alone = alone or isinstance(stmt, ast.If) and bool(
                    ONE_PROCESS.search(ast.unparse(stmt.test)))
                for field in ("body", "orelse", "finalbody"):
                    yield from walk(getattr(stmt, field, []), in_step or step, alone)
                for handler in getattr(stmt, "handlers", []):
                    yield from walk(handler.body, in_step or step, alone)
        yield from walk(self.tree.body, False)

    def problems(self) -> list[str]:
        """Statements that make a collective without the mark, and marks on statements that make
        none (the step's block is covered by its `with` line)."""
        found, explained = [], set()
        for first, last, calls, in_step, alone in self.statements():
            lines = set(range(first, last + 1))
            collective = [self.name(c) for c in calls
                          if self.name(c) == STEP or self.reaches(self.name(c))]
            if collective:
                explained |= lines
            if collective and not in_step and not lines & self.marked:
                found.append(f"line {first}: {', '.join(collective)} without '# ALL'")
            if collective and alone:
                found.append(f"line {first}: {', '.join(collective)} on one process only: the "
                             f"others would wait for it until --dist-timeout")
        found += [f"line {line}: '# ALL' on no collective"
                  for line in sorted(self.marked - explained)]
        return found


def script(name: str) -> Script:
    return Script((ROOT / "scripts" / f"{name}.py").read_text())


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_collective_call_is_marked_and_every_mark_is_on_one(name):
    problems = script(name).problems()
    assert not problems, (f"scripts/{name}.py: mark each statement that every process must make "
                          f"with a comment '# ALL' (tests/test_collectives.py):\n"
                          + "\n".join(problems))


def test_the_list_is_what_the_code_says():
    """A call the scripts make is on COLLECTIVES iff the code shows it reaches a collective, and
    nothing is on the list that no script calls."""
    called = {}
    for name in SCRIPTS:
        parsed = script(name)
        for call in (call for _, _, calls, *_ in parsed.statements() for call in calls):
            if (callee := parsed.name(call)) and callee != STEP:
                called[callee] = called.get(callee, False) or parsed.reaches(callee)
    reaching = {callee for callee, reaches in called.items() if reaches}
    assert reaching - COLLECTIVES == set(), "collectives missing from COLLECTIVES"
    assert COLLECTIVES - reaching == set(), "on COLLECTIVES but making no collective, or not called"


def test_the_reading_of_common_knows_its_collectives():
    """Spot checks of the call graph: direct and indirect collectives, and functions that are
    not."""
    for name in ("agree", "from_main", "fail_together", "save_checkpoint", "mean_over_processes",
                 "write_config", "load_inputs", "utilisation_figures",
                 "ShardedWeightAverage.state_dict"):
        assert name in COMMON.reaching, name
    for name in ("record_epoch", "start_tracking", "start_line", "build_model", "set_peak_lr",
                 "why_not_written", "StepLogger.log", "SkippedSteps.figures", "SkippedSteps.count",
                 "Stop.exit_code"):
        assert name not in COMMON.reaching, name


SAMPLE = '''
    from accelerate import Accelerator
    from common.run.checkpoints import resume_from
    from common.parallel.step_guard import StepGuard


    def main(args):
        accelerator = Accelerator()  # ALL
        guard = StepGuard(accelerator, None)
        resume_from(accelerator, None, None, {{}}, set()){resume}
        with accelerator.accumulate(model):  # ALL: the step
            accelerator.backward(loss)
        stop = guard.check(loss, 1){check}
        accelerator.print("done"){done}
'''


@pytest.mark.parametrize("resume, check, done, expected", [
    ("  # ALL", "  # ALL: every step", "", []),
    ("", "  # ALL", "", ["line 10: resume_from without '# ALL'"]),
    ("  # ALL", "", "", ["line 13: StepGuard.check without '# ALL'"]),
    ("  # ALL", "  # ALL", "  # ALL", ["line 14: '# ALL' on no collective"]),
    ("  # ALL", "  # not ALL", "", ["line 13: StepGuard.check without '# ALL'"]),
])
def test_the_check_catches_a_missing_mark_and_a_stray_one(resume, check, done, expected):
    # Negative controls: a mark taken off, a mark on a call that is no collective.
    text = textwrap.dedent(SAMPLE.format(resume=resume, check=check, done=done))
    assert Script(text).problems() == expected


def test_the_check_catches_a_collective_on_the_main_process_only():
    # Negative control: the hang the mark warns about, marked or not.
    text = textwrap.dedent(SAMPLE.format(resume="  # ALL", check="  # ALL", done=""))
    text = text.replace("    stop = guard.check(loss, 1)  # ALL\n",
                        "    if accelerator.is_main_process:\n"
                        "        stop = guard.check(loss, 1)  # ALL\n")
    assert Script(text).problems() == [
        "line 14: StepGuard.check on one process only: the others would wait for it until "
        "--dist-timeout"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_says_the_rule(name):
    doc = ast.get_docstring(script(name).tree)
    assert '"# ALL"' in doc, f"scripts/{name}.py's docstring does not say what '# ALL' marks"
