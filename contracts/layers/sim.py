"""Source mutants of the simulated device (backends/sim.py) and its race checker (_hazards.py)."""

from lockstep.contracts.mutation import Mutant

_H = "lockstep.reference_runtime.backends._hazards"
_HAZ_TESTS = ("tests/test_hazards.py", "tests/test_sim_device.py")

MUTANTS = [
    Mutant(
        "sim", "race_read_read_conflicts", _H,
        old="or not (old.write or new.write):",
        new="or not (old.write and new.write):",
        breaks="a cross-stream read after an unordered write is a StreamOrderRace (only read/read is harmless)",
        tests=_HAZ_TESTS, ci=True,
    ),
    Mutant(
        "sim", "race_supersede_ignores_bytes", _H,
        old="if not (a.before(new.vc) and new.lo <= a.lo and a.hi <= new.hi and (new.write or not a.write))]",
        new="if not (a.before(new.vc) and (new.write or not a.write))]",
        breaks="a later access to other bytes of an allocation does not hide an earlier access's record",
        tests=_HAZ_TESTS, ci=True,
    ),
    Mutant(
        "sim", "race_ordering_off_by_one", _H,
        old="return self.vc[self.stream] <= vc.get(self.stream, 0)",
        new="return self.vc[self.stream] <= vc.get(self.stream, 0) + 1",
        breaks="an access is ordered before another only when the other's clock has seen it (no off-by-one)",
        tests=_HAZ_TESTS,
    ),
]
