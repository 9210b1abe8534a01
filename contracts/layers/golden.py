"""Source mutants of the golden locks: anchors and bands (golden/anchors.py), the oracle's float64
cross-check (golden/oracle.py), provenance, the fatal lock and the tripwire (golden/locks.py,
golden/catalog.py), teacher forcing (lockstep/decoding.py) and `lockstep golden regenerate`."""

from lockstep.contracts.mutation import Mutant

_A = "lockstep.golden.anchors"
_L = "lockstep.golden.locks"
_MUT = "tests/test_golden_mutants.py"
_CLI = "tests/test_golden_cli.py"
_ORACLE = "contracts/suite/test_builtin_snapshots.py"


def _oracle_of(model: str) -> dict:
    """The reference suite's check that recomputes a built-in snapshot from the oracle (one model)."""
    return dict(tests=(_ORACLE,), marks="golden", select=f"snapshot_is_the_oracle and {model}]")


MUTANTS = [
    # -- proposals: a hint for the oracle's greedy prefix ---------------------------------------------
    Mutant(
        "golden", "proposal_keeps_int8_a", "lockstep.golden.propose",
        old="    model = exact_a(model)\n",
        new="",
        breaks="an engine proposes the greedy chain with MatMulNBits computing A in float, as the oracle does",
        tests=("tests/test_propose.py",), select="float",
    ),
    # -- the oracle's compiled 4-bit dequantization ------------------------------------------------
    Mutant(
        "golden", "oracle_int4_rows_high_nibble_first", "lockstep.golden.int4_host",
        old="out[n, at + 2 * j] = table[v & 15]",
        new="out[n, at + 2 * j] = table[v >> 4]",
        breaks="the oracle's compiled int4 rows read each byte's low nibble first, as its numpy passes do",
        tests=("tests/test_int4_host.py",),
    ),
    # -- bands: the error model per precision ------------------------------------------------------
    Mutant(
        "golden", "fp16_band_inflated", _A,
        old='"float16": 2.0**-11,',
        new='"float16": 2.0**-1,',
        breaks="the fp16 near-tie band is the error model's, so a divergence outside it is fatal for an fp16 engine",
        tests=(_MUT,), select="fp16_band_inflated", ci=True,
    ),
    Mutant(
        "golden", "tf32_operand_rounding_ignored", _A,
        old="u_o = UNIT_ROUNDOFF[operand] if UNIT_ROUNDOFF[operand] > u_s else 0.0",
        new="u_o = 0.0",
        breaks="the tf32 band counts the rounding of matrix-product operands below their storage format",
        **_oracle_of("tiny-fp32-standard"),
    ),
    Mutant(
        "golden", "finer_precision_band", _A,
        old="if UNIT_ROUNDOFF[storage] >= UNIT_ROUNDOFF[dtype]]",
        new="if UNIT_ROUNDOFF[storage] <= UNIT_ROUNDOFF[dtype]]",
        breaks="a snapshot holds bands only for precisions whose storage is no finer than the model's dtype",
        **_oracle_of("tiny-fp16-standard"),
    ),
    Mutant(
        "golden", "accuracy_level_ignored", _A,
        old="if level in ACCURACY_LEVEL_ROUNDOFF:",
        new="if False:",
        breaks="a model whose MatMulNBits declare accuracy_level gets the band of the arithmetic it allows (int8 A)",
        tests=("tests/test_golden_accuracy_level.py",), select="provenance_says_so",
    ),
    Mutant(
        "golden", "int8_activation_band_inflated", _A,
        old="ACCURACY_LEVEL_ROUNDOFF = {2: 2.0**-11, 3: 2.0**-8, 4: 1 / 254}",
        new="ACCURACY_LEVEL_ROUNDOFF = {2: 2.0**-11, 3: 2.0**-8, 4: 1 / 16}",
        breaks="the int8-activation term is half an int8 step, not wider (a wider band hides real MatMulNBits bugs)",
        **_oracle_of("genai-llama-int4-cpu"),
    ),
    # -- anchors: positions, the oracle's own check, the float64 cross-check -----------------------
    Mutant(
        "golden", "anchors_drop_last_position", _A,
        old="for i in range(start, len(context) - 1):",
        new="for i in range(start, len(context) - 2):",
        breaks="the anchors cover every position from the last prompt token to the last-but-one context token",
        tests=(_MUT,), select="cross_check_disagreeing",
    ),
    Mutant(
        "golden", "oracle_greedy_check_dropped", _A,
        old="if top1 != context[i + 1]:",
        new="if top1 != context[i + 1] and False:",
        breaks="an anchor's top-1 is the oracle's own recorded greedy token, else regeneration refuses",
        tests=(_MUT,), select="not_its_recorded_token",
    ),
    Mutant(
        "golden", "crosscheck_disagreement_ignored", _A,
        old="if diff > fp32_band or (margin > fp32_band",
        new="if diff > fp32_band and (margin > fp32_band",
        breaks="oracle and float64 cross-check differing by more than the fp32 band refuses regeneration",
        tests=(_MUT,), select="cross_check_disagreeing", ci=True,
    ),
    Mutant(
        "golden", "crosscheck_not_float64", "lockstep.golden.oracle",
        old="return np.asarray(ex.run(feeds)[io.logits][0], np.float64)",
        new="return np.asarray(ex.run(feeds)[io.logits][0].astype(np.float32), np.float64)",
        breaks="the cross-check's logits keep float64 precision (fp32 rounding would blur the fp32 band it judges)",
        tests=(_MUT,), select="float64",
    ),
    Mutant(
        "golden", "crosscheck_stream_not_float64", "lockstep.golden.oracle",
        old="(logits,) = Float64Stream(model_fp32).run([io.logits], _feeds(model_fp32, ids, io))",
        new="(logits,) = Float64Stream(model_fp32).run([io.logits], _feeds(model_fp32, ids, io))\n"
            "    logits = [logits[0].astype(np.float32)]",
        breaks="the streamed cross-check's logits (every model without a subgraph) keep float64 precision",
        tests=(_MUT,), select="float64",
    ),
    # -- snapshot I/O and comparison ---------------------------------------------------------------
    Mutant(
        "golden", "snapshot_missing_keys_accepted", _A,
        old="if not isinstance(data, dict) or missing:",
        new="if not isinstance(data, dict):",
        breaks="a JSON file that is not a lockstep snapshot (missing keys) is a ValueError naming the file",
        tests=(_CLI,), select="corrupt or not_a_snapshot",
    ),
    Mutant(
        "golden", "snapshot_write_not_atomic", _A,
        old="return atomic_write(directory / f\"{data['model']}.json\", snapshot_text(data))",
        new="(directory / f\"{data['model']}.json\").write_text(snapshot_text(data))\n"
            "    return directory / f\"{data['model']}.json\"",
        breaks="a snapshot is written atomically: a killed write leaves the old file, its temporary removed next time",
        tests=("tests/test_bad_models.py",), select="killed_write",
    ),
    Mutant(
        "golden", "comparison_ignores_missing_keys", _A,
        old="return a.keys() == b.keys() and all(",
        new="return all(",
        breaks="two snapshots are the same golden data only with the same keys (a field added or lost is a change)",
        tests=(_CLI,), select="comparison",
    ),
    # -- provenance --------------------------------------------------------------------------------
    Mutant(
        "golden", "generator_version_not_compared", _L,
        old='if prov.get("model_sha256") != sha or prov.get("generator_version") != GENERATOR_VERSION:',
        new='if prov.get("model_sha256") != sha:',
        breaks="a snapshot from another generator version fails with 'model changed: regenerate'",
        tests=(_MUT,), select="provenance", ci=True,
    ),
    Mutant(
        "golden", "user_model_sha_not_compared", "lockstep.golden.catalog",
        old='if prov.get("model_sha256") != sha:',
        new='if False:',
        breaks="a user's model file whose sha256 moved fails with 'model changed: regenerate'",
        tests=(_MUT,), select="provenance",
    ),
    # -- the fatal lock ----------------------------------------------------------------------------
    Mutant(
        "golden", "lock_skips_last_position", _L,
        old='for entry in snap["positions"]:',
        new='for entry in snap["positions"][:-1]:',
        breaks="the lock checks every anchored position outside the band (its position count)",
        tests=(_MUT,), select="real_decoder or last_anchored", ci=True,
    ),
    Mutant(
        "golden", "near_tie_by_engine_margin", _L,
        old='if entry["margin"] <= band:',
        new="if margin <= band:",
        breaks="a near-tie is decided by the oracle's margin, never by the engine's (its error cannot excuse itself)",
        tests=(_MUT,), select="never_a_near_tie",
    ),
    Mutant(
        "golden", "margin_check_one_sided", _L,
        old='elif abs(margin - entry["margin"]) > 2 * band:',
        new='elif margin - entry["margin"] > 2 * band:',
        breaks="an engine margin off the oracle's by more than twice the band is a violation, shrunk or grown",
        tests=(_MUT,), select="margin",
    ),
    Mutant(
        "golden", "lock_ok_with_nothing_checked", _L,
        old="return self.checked > 0 and not self.violations",
        new="return not self.violations",
        breaks="a lock that checked no position (all near-ties) is not a pass",
        tests=(_MUT,), select="checked_no_position",
    ),
    # -- the tripwire -----------------------------------------------------------------------------
    Mutant(
        "golden", "tripwire_any_token_at_a_near_tie", _L,
        old="near_tie = entry[\"margin\"] <= band and (allowed is None or got in allowed)",
        new="near_tie = entry[\"margin\"] <= band",
        breaks="a divergence at a near-tie is benign only to a token within the band of the oracle's top-1",
        tests=(_MUT,), select="off_set",
    ),
    Mutant(
        "golden", "lock_skips_near_ties_whole", _L,
        old="if allowed is not None and got not in allowed:",
        new="if False:",
        breaks="the teacher-forced lock holds a near-tie position's argmax to the tokens within the band",
        tests=(_MUT,), select="off_set",
    ),
    Mutant(
        "golden", "tripwire_fp32_band", _L,
        old="band = band_for(snap, precision)\n    result = greedy(",
        new='band = band_for(snap, "fp32")\n    result = greedy(',
        breaks="the tripwire classifies a divergence with the band of the engine's declared precision",
        tests=(_MUT,), select="near_tie",
    ),
    Mutant(
        "golden", "tripwire_short_stream", _L,
        old='result = greedy(session, snap["prompt"], len(prefix))',
        new='result = greedy(session, snap["prompt"], len(prefix) - 1)',
        breaks="the tripwire compares the whole recorded prefix, its last token included",
        tests=(_MUT,), select="tripwire or divergence",
    ),
    # -- teacher forcing ---------------------------------------------------------------------------
    Mutant(
        "golden", "teacher_force_keeps_cache", "lockstep.decoding",
        old="_check_context(session, io, len(context))\n    session.reset()\n",
        new="_check_context(session, io, len(context))\n",
        breaks="teacher forcing starts from an empty cache whatever the session ran before",
        tests=(_MUT,), select="real_decoder",
    ),
    # -- lockstep golden regenerate ----------------------------------------------------------------
    Mutant(
        "golden", "check_writes_snapshots", "lockstep.conformance.cli",
        old="if not (args.dry_run or args.check):",
        new="if not args.dry_run:",
        breaks="`lockstep golden regenerate --check` writes nothing",
        tests=("tests/test_fail_closed.py::test_regenerate_check_fails_on_drift_and_passes_when_clean",),
    ),
    Mutant(
        "golden", "regenerate_exact_comparison", "lockstep.conformance.cli",
        old="if old is not None and same_anchors(old, new):",
        new="if old is not None and old == new:",
        breaks="regenerate judges a snapshot unchanged with syrupy's tolerant comparison (oracle version informational)",
        tests=(_CLI,), select="patch_release",
    ),
]
