"""The reference runtime's own tests: what the reference engines (ref-sim, ref-cuda) bring to a run
that selects them (their ``self_tests``), kept out of the suite users run on their own engines.

- ``runtime/``: the runtime primitives' contract tests (``-m contract``, killed by every mutant of
  ``lockstep.contracts.mutants``: ``lockstep mutants``) and the simulator-vs-CUDA parity scenarios;
- the capture-guard pass over ONNX's node cases, the capture census, the two graph slots, paging and
  the sync cross-check on the golden models, the static sync audit of the tree, and the oracle check
  of lockstep's own golden snapshots.

Run with ``pytest contracts/suite`` in a checkout, ``pytest --pyargs lockstep.contracts.suite``
anywhere lockstep is installed, or ``lockstep check`` with a reference engine selected. Their fixtures
(``device``, ``make_runtime``, ``ref_engine``, ``--devices``, ``--lockstep-mutant``) come from
``lockstep.contracts.pytest_plugin``; ``engine`` and ``golden_model`` from the suite's plugin.
"""
