"""Native planning core (Rust, built by maturin). Graphs and schedules are JSON strings in the
formats of docs/formats.md; a ``Graph`` keeps a graph parsed for repeated calls."""

from remat.planner import SolverOptions

__version__: str

def budget_bytes(budget: int | float, plain_peak: int) -> int:
    """The one budget rule: bytes stay bytes, a fraction in (0, 1] is of ``plain_peak``; anything
    else raises ValueError saying what a budget is."""

def parse_budget(text: str) -> int | float:
    """``"300000"``, ``"512MiB"``, ``"2GiB"``, ``"1.5GB"``: bytes (an int); ``"0.4"``: a fraction.
    Raises ValueError otherwise."""

class Graph:
    """A graph file parsed and validated once, kept in Rust for every plan, stage and replay on it;
    each method releases the GIL while it works."""

    def __init__(self, graph_json: str) -> None:
        """Parses ``graph_json``. Raises remat.GraphError on a malformed graph."""

    def plan(self, budget: int, options: SolverOptions) -> str:
        """Schedule JSON of least time whose simulated peak, with what the executor holds beside
        the values, is at most ``budget`` bytes, by ``options.solver`` (the settings are read
        from ``options``' attributes). Raises
        remat.InfeasibleBudget below the smallest feasible budget, remat.ArgumentError on a bad
        setting."""

    def stages(self, options: SolverOptions) -> str:
        """The planner's stages as JSON (``remat.graphs``): ``groups`` of the simplified graph
        (member and allocating node ids, phase, time, temp_bytes, input and output storages),
        ``storages`` (owner value, bytes, producing group), ``blocks`` (forward and backward
        groups, class) and ``classes`` (anonymized key, blocks, search status, options with their
        times, saved bytes and peaks)."""

    def simulate(self, schedule_json: str) -> str:
        """Replays a schedule: JSON report with peak_bytes, forward_peak_bytes,
        backward_peak_bytes, forward_end_bytes, backward_start_bytes, time, recomputed_time,
        beside_bytes and step_peak_bytes.
        Raises remat.ScheduleError if the schedule is invalid."""

    def memory_curve(self, schedule_json: str | None = None) -> str:
        """The replay op by op (plain PyTorch's without a schedule): a JSON list of points with
        phase, op ("compute" with node, or "free" with value), bytes (alive after the op), peak
        (with its temporaries) and, for a compute op, run (1 for the first run of its node)."""

    def budget_range(self) -> tuple[int, int]:
        """(smallest feasible budget, what the executor holds beside the values included; plain
        PyTorch's peak) in bytes."""

    def plain_peak(self) -> int:
        """Plain PyTorch's peak in bytes (``budget_range``'s second, which is cheaper alone)."""

    def to_json(self) -> str:
        """The graph file text."""

def chain_plan(chain_json: str, mem_limit: int, slots: int) -> str:
    """rotor's DP over a chain of blocks (a ``remat.chain`` file, docs/checkpointable.md): the
    ``remat.chain_sequence`` JSON of least time whose replayed peak is at most ``mem_limit`` bytes,
    with rotor's notation and the predicted time and memory.

    Raises remat.InfeasibleBudget (naming the smallest feasible limit) below it, remat.GraphError
    on a malformed chain. Releases the GIL while solving.
    """

def chain_limits(chain_json: str, slots: int) -> tuple[int, int]:
    """(smallest feasible limit with ``slots`` slots, plain PyTorch's peak) in bytes."""

def check_options(options: SolverOptions) -> None:
    """Raises remat.ArgumentError, saying what is allowed, where a setting of ``plan`` is bad."""

def default_options() -> dict[str, str | float | int | bool]:
    """The solver's settings where a caller gives none (``solver``, ``time_limit``, ``mip_gap``,
    ``slots``, ``quick``): the one place they are written."""

def register_errors(
    graph: type[Exception],
    schedule: type[Exception],
    infeasible: type[Exception],
    argument: type[Exception],
    solver: type[Exception],
) -> None:
    """The classes each Rust error is raised as (called once, by ``remat.errors``)."""
