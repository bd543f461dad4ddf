"""Reliability of the tuner and of the tables on the CPU objective (no GPU).

The objective is the real :class:`fdpp.tune.DecodeBench` on the NumPy path (every candidate's
output verified against the float64 reference through ``fdpp.decode_attention``), timed by a fake,
deterministic cost of the plan. Worker processes run :func:`fdpp.tune.run_tuning` from a script
written by the test, so a process can be killed or several can share one study.

- a worker SIGKILLed in the middle of a trial leaves the SQLite study usable; rerunning the same
  command resumes (nothing measured before is measured again) and writes the table;
- 4 concurrent workers on one SQLite study and on one PostgreSQL study (a real server that the
  test starts on 127.0.0.1 and stops; skipped where no server binary exists): one consistent
  table, no duplicated or lost trials;
- a read-only tuning directory, a tuning path that cannot exist, and corrupt table files leave the
  library on the heuristic, with a warning, never an exception.

Every subprocess runs under a timeout and is stopped by the test (by pid) whatever happens.
The races these tests found are fixed, and each has a test that forces its interleaving (a
barrier at the racy step), so it fails on the unfixed code every time rather than sometimes:
two writers of one table (``write_table``'s lock), two SQLite workers claiming one enqueued trial
(transactions begin IMMEDIATE), workers creating a fresh PostgreSQL schema together
(``open_storage`` retries), and the rerun after a kill during the heuristic's trial (seed points
of RUNNING trials are enqueued again). The shared-study tests check, strictly, that no bucket
fails, no measurement is lost and the workers explore at least ``--trials`` distinct plans (each
seeds its sampler afresh).
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

optuna = pytest.importorskip("optuna")

from fdpp import dispatch, tables, tune  # noqa: E402
from fdpp.configs import SM90, DecodeProblem, default_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HEADS = tables.HeadConfig(8, 2, 64, "fp16")
SEQLENS = (256, 512)
WORKER_TIMEOUT = 240  # s, per worker process


@pytest.fixture(autouse=True)
def isolated(isolated_tuning):
    """No shipped table, a user table dir of the test's own, fresh dispatch caches (tests/conftest.py)."""


# ---- the worker -----------------------------------------------------------------------------
WORKER = textwrap.dedent('''
    """A tuning worker on the CPU objective (written by tests/test_tuner_reliability.py)."""
    import argparse, json, math, os, sys, time, warnings
    from pathlib import Path

    import numpy as np
    import optuna

    from fdpp import tables, tune
    from fdpp.configs import SM90

    ap = argparse.ArgumentParser()
    ap.add_argument("--storage", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--seqlens", default="256,512")
    ap.add_argument("--hang-at", type=int, default=0, help="block in the n-th measurement (1-based)")
    ap.add_argument("--barrier", type=int, default=0, help="wait for this many workers to be ready")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per measurement")
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.simplefilter("ignore")
    log_dir = Path(args.log_dir)
    log = (log_dir / f"{os.getpid()}.jsonl").open("a", buffering=1)
    heads = tables.HeadConfig(8, 2, 64, "fp16")
    buckets = [tables.Bucket(heads, int(n), 1) for n in args.seqlens.split(",")]
    count = [0]

    def cost(plan):
        s = plan.split
        return (10 + abs(math.log2(plan.num_splits) - 2) + (0 if s.num_warps == 4 else 0.5) + 0.1 * s.num_stages
                + 0.05 * s.unroll + (0.3 if s.mma else 0) + (0.02 * plan.combine.num_warps if plan.combine else 0))

    class CpuBench(tune.DecodeBench):
        def __init__(self, problem):
            super().__init__(problem, xp=np, verify_bytes=1 << 18, max_sets=1,
                             timer=lambda calls, cpr, rep: [c() for c in calls] and 1.0)
            inner, key = self.measure, tables.Bucket.of(problem).key

            def measure(plan):
                count[0] += 1
                pk = tune.plan_key(plan, problem.seqlen)
                log.write(json.dumps({"event": "start", "n": count[0], "bucket": key, "plan_key": pk}) + "\\n")
                if count[0] == args.hang_at:
                    (log_dir / f"hung-{os.getpid()}").touch()
                    time.sleep(3600)
                if args.sleep:
                    time.sleep(args.sleep)
                v = inner(plan)
                log.write(json.dumps({"event": "end", "n": count[0], "bucket": key, "plan_key": pk,
                                      "value": v}) + "\\n")
                return v

            self.measure = measure

        def time(self, plan):
            super().time(plan)  # the timing calls run (through fdpp.decode_attention)
            return cost(plan)

    if args.barrier:
        (log_dir / f"ready-{os.getpid()}").touch()
        t0 = time.time()
        while len(list(log_dir.glob("ready-*"))) < args.barrier and time.time() - t0 < 60:
            time.sleep(0.01)
    run = tune.run_tuning(buckets, SM90, CpuBench, storage=tune.open_storage(args.storage), out_dir=args.out,
                          trials=args.trials, rounds=0, progress=False)
    print(json.dumps({"pid": os.getpid(), "table": str(run.table), "interrupted": run.interrupted,
                      "aborted": run.aborted,
                      "results": [{"bucket": r.bucket.key, "measured": r.measured, "new": r.new_trials,
                                   "error": r.error} for r in run.results]}))
''')


class Workers:
    """Worker processes of one test: started with a timeout, always stopped (by pid) at the end."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.script = tmp / "worker.py"
        self.script.write_text(WORKER)
        self.logs = tmp / "logs"
        self.logs.mkdir(exist_ok=True)
        self.procs: list[subprocess.Popen] = []

    def cmd(self, storage: str, out: Path, trials: int, *extra: str) -> list[str]:
        return [sys.executable, str(self.script), "--storage", storage, "--out", str(out), "--log-dir",
                str(self.logs), "--trials", str(trials), *extra]

    def start(self, cmd: list[str]) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "FDPP_TUNING_DIR": str(self.tmp / "user")}
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.procs.append(p)
        return p

    def finish(self, p: subprocess.Popen, timeout: float = WORKER_TIMEOUT) -> dict:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate(timeout=30)
            raise AssertionError(f"worker {p.pid} timed out after {timeout} s; stderr:\n{err[-3000:]}") from None
        assert p.returncode == 0, f"worker {p.pid} exited {p.returncode}; stderr:\n{err[-3000:]}"
        return json.loads(out.strip().splitlines()[-1])

    def events(self, pid: int | None = None) -> list[dict]:
        files = [self.logs / f"{pid}.jsonl"] if pid is not None else sorted(self.logs.glob("*.jsonl"))
        out = []
        for f in files:
            for line in f.read_text().splitlines():
                out.append({**json.loads(line), "pid": int(f.stem)})
        return out

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(Exception):
                p.communicate(timeout=30)


@pytest.fixture
def workers(tmp_path):
    w = Workers(tmp_path)
    try:
        yield w
    finally:
        w.stop_all()


def _problem(seqlen: int) -> DecodeProblem:
    return tables.Bucket(HEADS, seqlen, 1).problem()


def _study(storage: str | object, seqlen: int):
    p = _problem(seqlen)
    name = tune.study_name(SM90, tables.Bucket.of(p), tune.search_space(p, SM90))
    st = tune.open_storage(storage) if isinstance(storage, str) else storage
    return optuna.load_study(study_name=name, storage=st), name


def _measured(study) -> list:
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return [t for t in done if "plan_key" in t.user_attrs and "repeat_of" not in t.user_attrs]


def _wait_for(path_glob: str, proc: subprocess.Popen, timeout: float) -> Path:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        hits = glob.glob(path_glob)
        if hits:
            return Path(hits[0])
        if proc.poll() is not None:
            raise AssertionError(f"worker exited ({proc.returncode}) before reaching the point to kill: "
                                 f"{proc.stderr.read()[-2000:] if proc.stderr else ''}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {path_glob}")


# ---- (a) SIGKILL mid-trial, then resume -----------------------------------------------------
@pytest.mark.parametrize("hang_at", [3, 9])  # 3: in the first bucket; 9: in the second (trials=6)
def test_sigkill_mid_trial_then_rerun_resumes(tmp_path, workers, hang_at):
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    out = tmp_path / "tuning"
    trials = 6
    p = workers.start(workers.cmd(url, out, trials, "--hang-at", str(hang_at)))
    _wait_for(str(workers.logs / f"hung-{p.pid}"), p, WORKER_TIMEOUT)
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=30)
    assert p.returncode == -signal.SIGKILL

    # the study is usable: it loads and holds the finished trials and the one killed mid-way
    killed_bucket = 0 if hang_at <= trials else 1
    first = [e for e in workers.events(p.pid) if e["event"] == "end"]
    assert len(first) == hang_at - 1
    study, _ = _study(url, SEQLENS[killed_bucket])
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    assert len(running) == 1, "the killed trial should be left RUNNING (no heartbeat)"
    done_before = {(e["bucket"], e["plan_key"]) for e in first}
    if killed_bucket == 1:  # the first bucket was finished and written before the kill
        assert set(tables.read_table(out / "NVIDIA_H200.json", SM90).entries) == {
            tables.Bucket(HEADS, SEQLENS[0], 1).key}

    # the same command again: resumes, measures nothing twice, writes the table
    p2 = workers.start(workers.cmd(url, out, trials))
    res = workers.finish(p2)
    assert not res["interrupted"] and not res["aborted"]
    assert all(r["error"] is None for r in res["results"]), res
    second = [e for e in workers.events(p2.pid) if e["event"] == "end"]
    again = done_before & {(e["bucket"], e["plan_key"]) for e in second}
    assert not again, f"plans measured before the kill were measured again: {again}"
    t = tables.read_table(out / "NVIDIA_H200.json", SM90)
    assert t.error is None and not t.rejected
    assert set(t.entries) == {tables.Bucket(HEADS, n, 1).key for n in SEQLENS}
    for n in SEQLENS:
        study, name = _study(url, n)
        meas = _measured(study)
        assert len(meas) >= trials
        e = t.entries[tables.Bucket(HEADS, n, 1).key]
        assert e.meta["study"] == name and e.meta["trials"] == len(meas)
        best = min(x.value for x in meas if math.isfinite(x.value))
        # the fastest, or a plan of fewer launches within the launch tie (tune.prefer_fewer_launches)
        assert best * (1 - 1e-3) <= e.time_us <= best + min(tune.LAUNCH_TIE * best, tune.LAUNCH_TIE_US) + 1e-3 * best
        assert e.heuristic_time_us is not None, "the heuristic's plan was never measured"
        by_key = {x.user_attrs["plan_key"] for x in meas}
        assert len(by_key) == len(meas), "a plan was measured twice in one study"


def test_sigkill_in_the_heuristic_trial_still_measures_the_heuristic(tmp_path, workers):
    """The killed heuristic trial (the first, enqueued one) stays RUNNING with its params; the rerun
    enqueues it again (a RUNNING or FAIL trial does not count as measured) and measures it, so
    the entry has the heuristic's time (rounds=0)."""
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    out = tmp_path / "tuning"
    p = workers.start(workers.cmd(url, out, 6, "--hang-at", "1", "--seqlens", "256"))
    _wait_for(str(workers.logs / f"hung-{p.pid}"), p, WORKER_TIMEOUT)
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=30)
    res = workers.finish(workers.start(workers.cmd(url, out, 6, "--seqlens", "256")))
    e = tables.read_table(out / "NVIDIA_H200.json", SM90).entries[tables.Bucket(HEADS, 256, 1).key]
    assert e.heuristic_time_us is not None
    heur = tune.plan_key(default_config(_problem(256), SM90), 256)
    assert heur in {x["plan_key"] for x in workers.events(res["pid"]) if x["event"] == "end"}


# ---- (b) 4 workers on one study --------------------------------------------------------------
N_WORKERS = 4


def _check_shared_run(workers: Workers, storage: str, out: Path, trials: int, results: list[dict]) -> dict:
    """The invariants of several workers on one study; returns counts per bucket."""
    stats: dict = {}
    for r in results:
        assert not r["interrupted"] and not r["aborted"], r
        for x in r["results"]:
            assert x["error"] is None, f"worker {r['pid']}: bucket {x['bucket']} failed: {x['error']}"
    ends = [e for e in workers.events() if e["event"] == "end"]
    assert {e["pid"] for e in ends} <= {r["pid"] for r in results}
    t = tables.read_table(out / "NVIDIA_H200.json", SM90)
    assert t.error is None and not t.rejected, (t.error, t.rejected)
    assert set(t.entries) == {tables.Bucket(HEADS, n, 1).key for n in SEQLENS}
    for n in SEQLENS:
        key = tables.Bucket(HEADS, n, 1).key
        study, name = _study(storage, n)
        space = tune.search_space(_problem(n), SM90)
        trials_all = study.get_trials(deepcopy=False)
        numbers = sorted(x.number for x in trials_all)
        assert numbers == list(range(len(numbers))), "trial numbers are not unique and dense"
        assert len({x._trial_id for x in trials_all}) == len(trials_all)
        states = {s.name: sum(x.state == s for x in trials_all) for s in optuna.trial.TrialState}
        assert states["RUNNING"] == 0 and states["FAIL"] == 0, states
        for x in trials_all:
            if x.state == optuna.trial.TrialState.COMPLETE:
                assert set(x.params) == set(space), (x.number, x.params)
                assert all(x.params[k] in space[k] for k in space), (x.number, x.params)
        meas = _measured(study)
        # no lost trials: every COMPLETE measured trial is a measurement its worker logged, and every
        # logged measurement is stored (no two workers ran one trial)
        logged = sorted((e["pid"], e["plan_key"], e["value"]) for e in ends if e["bucket"] == key)
        stored = sorted((x.user_attrs["pid"], x.user_attrs["plan_key"], x.value) for x in meas)
        assert stored == logged, f"{key}: the measurements logged and the trials stored differ"
        assert len(meas) >= trials
        e = t.entries[key]
        assert e.meta["study"] == name
        winner = [x for x in meas if tune.plan_key(tune.plan_from_params(_problem(n), x.params), n)
                  == tune.plan_key(e.plan(), n)]
        assert winner and e.time_us == pytest.approx(winner[0].value, rel=1e-3), \
            "the entry is not a measured trial of the study"
        keys = [x.user_attrs["plan_key"] for x in meas]
        stats[key] = {"trials": len(trials_all), "measured": len(meas), "distinct": len(set(keys)),
                      "duplicate_measurements": len(keys) - len(set(keys)), "states": states,
                      "entry_is_best": e.time_us == pytest.approx(min(x.value for x in meas), rel=1e-3)}
    return stats


def _run_shared(workers: Workers, storage: str, out: Path, trials: int) -> list[dict]:
    procs = [workers.start(workers.cmd(storage, out, trials, "--barrier", str(N_WORKERS), "--sleep", "0.02"))
             for _ in range(N_WORKERS)]
    return [workers.finish(p) for p in procs]


def _report_shared(kind: str, stats: dict, trials: int) -> None:
    print(f"{kind}, {N_WORKERS} workers:", json.dumps(stats))
    for k, s in stats.items():
        assert s["duplicate_measurements"] <= 2 * N_WORKERS + 2, s  # bounded, whatever the timing
        # --trials counts distinct plans: workers seeded alike would explore fewer
        assert s["distinct"] >= trials, f"{k}: {s['distinct']} distinct plans of {s['measured']} measured"


def test_four_workers_share_one_sqlite_study(tmp_path, workers):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    out = tmp_path / "tuning"
    trials = 10
    results = _run_shared(workers, url, out, trials)
    _report_shared("sqlite", _check_shared_run(workers, url, out, trials, results), trials)


class _PlanLog:
    """A Bench factory on a made-up cost that logs the plans measured, in order."""

    def __init__(self):
        self.calls: list[str] = []

    def __call__(self, problem):
        log = self

        class Bench:
            def measure(self, plan):
                log.calls.append(tune.plan_key(plan, problem.seqlen))
                return 10.0 + abs(math.log2(plan.num_splits) - 2) + 0.1 * plan.split.num_stages

            def close(self):
                pass

        return Bench()


def _plans_of_a_worker(tmp_path: Path, name: str, **kw) -> list[str]:
    """The plans a worker starting on an empty study measures (its own storage: the same start
    that workers launched together on one study see)."""
    bench = _PlanLog()
    storage = tune.open_storage(f"sqlite:///{tmp_path / name}.db")
    tune.run_tuning([tables.Bucket(HEADS, 512, 1)], SM90, bench, storage=storage, out_dir=tmp_path / name,
                    trials=8, rounds=0, progress=False, **kw)
    assert len(bench.calls) == 8
    return bench.calls


def test_workers_started_together_explore_different_plans(tmp_path):
    """Without --seed every worker seeds its sampler afresh: two that start on the same (empty)
    study suggest different plans (one seed for all made them suggest the same ones). With one
    --seed, different --worker indices differ, and one index reproduces itself."""
    a, b = (_plans_of_a_worker(tmp_path, n) for n in ("a", "b"))
    assert a != b
    s0, s1, s0_again = (_plans_of_a_worker(tmp_path, n, seed=7, worker=w) for n, w in (("c", 0), ("d", 1), ("e", 0)))
    assert s0 != s1 and s0 == s0_again
    assert tune.build_parser().parse_args([]).seed is None
    help_text = " ".join(tune.build_parser().format_help().split())
    assert "--worker" in help_text and "fresh one in every process" in help_text


def _in_threads(n: int, fn) -> list:
    """``fn(i)`` in ``n`` threads at once; returns what each returned or raised."""
    out: list = [None] * n

    def run(i):
        try:
            out[i] = fn(i)
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[i] = e

    ths = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in ths), "a thread hung"
    return out


def _wait_once_before(engine, prefix: str, barrier: threading.Barrier) -> None:
    """Each thread's first statement on ``engine`` starting with ``prefix`` waits at ``barrier``
    (until every party is there, or its timeout runs out)."""
    from sqlalchemy import event

    waited = set()

    def hook(_conn, _cursor, statement, *_a):
        if statement.lstrip().upper().startswith(prefix) and threading.get_ident() not in waited:
            waited.add(threading.get_ident())
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait()

    event.listen(engine, "before_cursor_execute", hook)


def test_two_sqlite_workers_never_claim_one_enqueued_trial(tmp_path):
    """Two workers (a storage each, as two processes) ask for a trial while one is enqueued; each
    claim's UPDATE to RUNNING waits (up to 2 s) for the other claim to have got that far. pysqlite
    without BEGIN IMMEDIATE reads the trial's state outside any transaction, so both see it
    WAITING and both claim it; serialised, the second sees it RUNNING and makes a new trial."""
    url = f"sqlite:///{tmp_path / 'claim.db'}"
    study = optuna.create_study(storage=tune.open_storage(url), study_name="claim")
    study.enqueue_trial({"x": 1})
    barrier = threading.Barrier(2, timeout=2)

    def ask(_i):
        st = tune.open_storage(url)
        _wait_once_before(st.engine, "UPDATE TRIALS SET STATE", barrier)
        return optuna.load_study(study_name="claim", storage=st).ask()._trial_id

    ids = _in_threads(2, ask)
    assert all(isinstance(i, int) for i in ids), ids
    assert len(set(ids)) == 2, "two workers claimed one enqueued trial"
    states = [t.state for t in optuna.load_study(study_name="claim", storage=url).trials]
    assert states == [optuna.trial.TrialState.RUNNING] * 2


# ---- PostgreSQL: a real server, started and stopped here ------------------------------------
def _pg_bindir() -> Path | None:
    cands = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if cands:
        return Path(cands[-1]).parent
    w = shutil.which("initdb")
    return Path(w).resolve().parent if w else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres():
    """A throwaway PostgreSQL server on 127.0.0.1 (a free port, trust auth, data in /tmp); yields
    a function making a fresh database and returning its SQLAlchemy URL. As root the server runs
    as ``nobody`` (PostgreSQL refuses root)."""
    bindir = _pg_bindir()
    if bindir is None or not (bindir / "pg_ctl").exists():
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl; Debian: apt-get install postgresql)")
    pytest.importorskip("psycopg2", reason="psycopg2-binary is in the test extra")
    pytest.importorskip("sqlalchemy")
    as_user: dict = {}
    base = Path(tempfile.mkdtemp(prefix="fdpp-pg-", dir="/tmp"))
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        as_user = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
        os.chown(base, nobody.pw_uid, nobody.pw_gid)
    data, logf = base / "data", base / "server.log"
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PGTZ": "UTC", "HOME": str(base)}
    started = False
    try:
        r = subprocess.run([str(bindir / "initdb"), "-D", str(data), "-U", "fdpp", "-A", "trust", "-E", "UTF8",
                            "--locale=C", "--no-sync"], capture_output=True, text=True, timeout=180,
                           env=env, cwd=base, **as_user)
        if r.returncode != 0:
            pytest.skip(f"initdb failed, no PostgreSQL server here: {r.stderr[-500:]}")
        for _ in range(3):
            port = _free_port()
            opts = (f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={base} "
                    "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=60")
            r = subprocess.run([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(logf), "-w", "-t", "60",
                                "-o", opts, "start"], capture_output=True, text=True, timeout=120, env=env,
                               cwd=base, **as_user)
            if r.returncode == 0:
                started = True
                break
        if not started:
            log = logf.read_text()[-1500:] if logf.exists() else ""
            pytest.skip(f"the PostgreSQL server did not start: {r.stderr[-500:]} {log}")
        import psycopg2

        made = []

        def new_database(name: str) -> str:
            conn = psycopg2.connect(host="127.0.0.1", port=port, user="fdpp", dbname="postgres",
                                    connect_timeout=10)
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f"CREATE DATABASE {name}")
            conn.close()
            made.append(name)
            return f"postgresql+psycopg2://fdpp@127.0.0.1:{port}/{name}"

        yield new_database
    finally:
        if started:
            subprocess.run([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "-t", "60", "stop"],
                           capture_output=True, text=True, timeout=90, env=env, cwd=base, **as_user)
        pidfile = data / "postmaster.pid"
        if pidfile.exists():  # pg_ctl could not stop it: kill the postmaster by its pid
            with contextlib.suppress(Exception):
                os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


def test_four_workers_share_one_postgresql_study(tmp_path, workers, postgres):
    """Steady state: the database already has optuna's schema (any earlier run made it)."""
    url = postgres("fdpp_shared")
    optuna.storages.RDBStorage(url).engine.dispose()  # creates the schema
    out = tmp_path / "tuning"
    trials = 10
    results = _run_shared(workers, url, out, trials)
    _report_shared("postgresql", _check_shared_run(workers, url, out, trials, results), trials)


def test_four_workers_start_on_a_fresh_postgresql_database(tmp_path, workers, postgres):
    """The first run: every worker also creates optuna's schema, at the same moment."""
    url = postgres("fdpp_fresh")
    out = tmp_path / "tuning"
    trials = 10
    results = _run_shared(workers, url, out, trials)
    _report_shared("postgresql (fresh database)", _check_shared_run(workers, url, out, trials, results), trials)


def test_workers_create_a_fresh_postgresql_schema_together(postgres):
    """Two workers open a fresh database at the same moment: each one's first CREATE waits for the
    other's (so both checked that the tables are absent); the loser's CREATE fails on the
    winner's (UniqueViolation / DuplicateTable) and open_storage retries it, finding the schema."""
    from sqlalchemy import engine as sa_engine

    url = postgres("fdpp_schema_race")
    barrier = threading.Barrier(2, timeout=20)
    mine = set()  # the two threads below: other engines of this process are left alone

    def create(_i):
        mine.add(threading.get_ident())
        st = tune.open_storage(url)
        return optuna.create_study(storage=st, study_name="s", load_if_exists=True)._study_id

    from sqlalchemy import event

    waited = set()

    def hook(_conn, _cursor, statement, *_a):
        me = threading.get_ident()
        if me in mine and me not in waited and statement.lstrip().upper().startswith("CREATE"):
            waited.add(me)
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait()

    event.listen(sa_engine.Engine, "before_cursor_execute", hook)
    try:
        ids = _in_threads(2, create)
    finally:
        event.remove(sa_engine.Engine, "before_cursor_execute", hook)
    assert len(waited) == 2 and not barrier.broken, "the two workers did not create the schema together"
    assert all(isinstance(i, int) for i in ids), ids
    assert ids[0] == ids[1]


def test_postgresql_kill_and_resume(tmp_path, workers, postgres):
    """The kill-and-resume of (a) on a server storage: the killed trial stays RUNNING, a rerun
    measures nothing twice."""
    url = postgres("fdpp_resume")
    out = tmp_path / "tuning"
    p = workers.start(workers.cmd(url, out, 5, "--hang-at", "3", "--seqlens", "256"))
    _wait_for(str(workers.logs / f"hung-{p.pid}"), p, WORKER_TIMEOUT)
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=30)
    before = {e["plan_key"] for e in workers.events(p.pid) if e["event"] == "end"}
    res = workers.finish(workers.start(workers.cmd(url, out, 5, "--seqlens", "256")))
    after = {e["plan_key"] for e in workers.events(res["pid"]) if e["event"] == "end"}
    assert len(before) == 2 and not before & after
    assert tables.Bucket(HEADS, 256, 1).key in tables.read_table(out / "NVIDIA_H200.json", SM90).entries


# ---- the table file under concurrent writers -------------------------------------------------
def _entry(seqlen: int, t: float) -> tables.Entry:
    b = tables.Bucket(HEADS, seqlen, 1)
    return tables.Entry.from_plan(b, default_config(b.problem(), SM90), time_us=t, heuristic_time_us=t)


def test_concurrent_write_table_keeps_both_entries(tmp_path, monkeypatch):
    """Two writers of different buckets: each read waits (up to 2 s) for the other writer to have
    read too. Without a lock both read the old file and the second write drops the first's entry;
    with it the second cannot read before the first has written (the wait runs out)."""
    out = tmp_path / "tuning"
    real = tables.read_table
    barrier = threading.Barrier(2, timeout=2)
    overlapped = []

    def read_then_wait(*a, **kw):  # both writers read before either writes, if nothing stops them
        t = real(*a, **kw)
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait()
            overlapped.append(True)
        return t

    monkeypatch.setattr(tables, "read_table", read_then_wait)
    errs = []

    def write(e):
        try:
            tables.write_table(out, SM90, [e])
        except Exception as ex:  # noqa: BLE001
            errs.append(ex)

    ths = [threading.Thread(target=write, args=(_entry(n, 5.0),)) for n in SEQLENS]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout=60)
    monkeypatch.setattr(tables, "read_table", real)
    assert not errs
    assert not overlapped, "both writers read the table before either wrote it"
    assert set(tables.read_table(out / "NVIDIA_H200.json", SM90).entries) == {
        tables.Bucket(HEADS, n, 1).key for n in SEQLENS}


def _gemm_write(out: Path, i: int, t: float) -> Path:
    from fdpp import gemm

    entry = gemm.GemmEntry.of(gemm.GemmPlan("cublas"), "fp16", 64, 64, 2 ** i, time_us=t)
    assert entry.key == _gemm_key(i)
    return gemm.write_table(out / gemm.table_filename(SM90.name), SM90, [entry])


def _gemm_key(i: int) -> str:
    from fdpp import gemm

    return gemm.table_key("fp16", 64, 64, 2 ** i)


def _gemm_times(path: Path) -> dict[str, float]:
    from fdpp import gemm

    return {k: e.time_us for k, e in gemm.read_table(path, SM90).entries.items()}


#: op -> (write entry i with time t into the tables dir, entry i's key, {key: time_us} of a file)
WRITERS = {
    "attention": (lambda out, i, t: tables.write_table(out, SM90, [_entry(SEQLENS[i], t)]),
                  lambda i: tables.Bucket(HEADS, SEQLENS[i], 1).key,
                  lambda path: {k: e.time_us for k, e in tables.read_table(path, SM90).entries.items()}),
    "gemm": (_gemm_write, _gemm_key, _gemm_times),  # flat GEMM's tables share the lock and the write
}


@pytest.mark.parametrize("op", WRITERS)
def test_write_table_waits_for_another_process(tmp_path, op):
    """The lock is between processes: a forked writer waits while this process holds the table's
    lock, then merges (the entry written meanwhile is kept)."""
    write, key, times = WRITERS[op]
    out = tmp_path / "tuning"
    path = write(out, 0, 5.0)
    rfd, wfd = os.pipe()
    pid = os.fork()  # before locking: a child would inherit the lock with the descriptor
    if pid == 0:  # the child: writes once told to, never returns
        code = 1
        try:
            os.close(wfd)
            os.read(rfd, 1)
            write(out, 1, 5.0)
            code = 0
        finally:
            os._exit(code)
    os.close(rfd)
    try:
        with tables._locked(path):
            os.write(wfd, b"x")
            time.sleep(0.5)
            assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the other process wrote while the lock was held"
            tables._replace(path, path.read_text().replace('"time_us": 5.0', '"time_us": 4.0'))
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    finally:
        os.close(wfd)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the writer did not finish after the lock was released")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert times(path) == {key(0): 4.0, key(1): 5.0}


# ---- (c) read-only tuning directory, corrupt tables ------------------------------------------
PROB = DecodeProblem(1, 32, 8, 128, 4096, "fp16")
CORRUPT = {
    "garbage": b"this is not json",
    "empty": b"",
    "truncated": b'{"schema": 1, "device": {"name": "NVIDIA H200"}, "entr',
    "top-level list": b"[]",
    "wrong schema": b'{"schema": 99, "entries": {}}',
    "nan schema": b'{"schema": NaN}',
    "entries not an object": b'{"schema": 1, "params": [], "device": {"name": "NVIDIA H200"}, "entries": 3}',
    "malformed entry": (b'{"schema": 1, "params": [], "device": {"name": "NVIDIA H200"}, '
                        b'"entries": {"q32.kv8.d128.fp16.n4096.b1": {"bucket": 7}}}'),
    "not utf-8": b"\xff\xfe\x00\x80 binary junk \xc3\x28",
    "deeply nested": b"[" * 200_000,
}


def _heuristic_with_warning(problem: DecodeProblem = PROB) -> None:
    dispatch.clear_cache()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        plan = dispatch.select_plan(problem, SM90)
        text = dispatch.explain(problem, SM90)
    assert plan.source == "heuristic" and plan == default_config(problem, SM90)
    assert any(issubclass(x.category, tables.TableWarning) for x in w), [str(x.message) for x in w]
    assert "heuristic" in text


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_corrupt_user_table_gives_the_heuristic_with_a_warning(tmp_path, name):
    user = tmp_path / "user"
    user.mkdir()
    (user / "NVIDIA_H200.json").write_bytes(CORRUPT[name])
    _heuristic_with_warning()


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_read_table_never_raises(tmp_path, name):
    f = tmp_path / "NVIDIA_H200.json"
    f.write_bytes(CORRUPT[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = tables.read_table(f, SM90)
    assert (t.error or t.rejected) and not t.entries


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_write_table_over_a_corrupt_file(tmp_path, name):
    """The tuner writes the table after every bucket: a corrupt file there is replaced."""
    out = tmp_path / "tuning"
    out.mkdir()
    (out / "NVIDIA_H200.json").write_bytes(CORRUPT[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tables.write_table(out, SM90, [_entry(256, 4.0)])
    assert set(tables.read_table(out / "NVIDIA_H200.json", SM90).entries) == {tables.Bucket(HEADS, 256, 1).key}


@pytest.mark.parametrize("name", ["garbage", "not utf-8", "deeply nested"])
def test_corrupt_user_table_keeps_the_shipped_one(tmp_path, name):
    """A broken user table must not hide a valid shipped table."""
    e = _entry(4096, 3.0)
    shipped = tables.shipped_dir()
    tables.write_table(shipped, SM90, [e])
    user = tmp_path / "user"
    user.mkdir()
    (user / "NVIDIA_H200.json").write_bytes(CORRUPT[name])
    p = _problem(4096)
    dispatch.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = dispatch.select_plan(p, SM90)
    assert plan.source == "table" and plan.split == e.split


def test_table_path_is_a_directory(tmp_path):
    (tmp_path / "user" / "NVIDIA_H200.json").mkdir(parents=True)
    _heuristic_with_warning()


def test_tuning_dir_that_cannot_exist(tmp_path, monkeypatch):
    """FDPP_TUNING_DIR under a regular file (not creatable, even by root): the heuristic (with an
    'unreadable' warning), no exception; dispatch never creates the directory."""
    f = tmp_path / "a-file"
    f.write_text("x")
    monkeypatch.setenv(tables.ENV_DIR, str(f / "tuning"))
    dispatch.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = dispatch.select_plan(PROB, SM90)
    assert plan.source == "heuristic" and plan == default_config(PROB, SM90)
    assert "heuristic" in dispatch.explain(PROB, SM90)


def _in_unprivileged_child(fn) -> dict:
    """``fn()`` in a forked child that, when this process is root (root ignores permission bits),
    first drops to ``nobody``; returns fn's JSON-able result. The child is killed after 60 s."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(rfd)
            if os.geteuid() == 0:
                pw = pwd.getpwnam("nobody")
                os.setgroups([])
                os.setgid(pw.pw_gid)
                os.setuid(pw.pw_uid)
            res = fn()
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            res = {"exception": f"{type(e).__name__}: {e}"}
        try:
            os.write(wfd, json.dumps(res).encode())
        finally:
            os._exit(code)
    os.close(wfd)
    deadline = time.monotonic() + 60
    while True:
        done, _status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the unprivileged child timed out")
        time.sleep(0.01)
    with os.fdopen(rfd, "rb") as f:
        return json.loads(f.read().decode() or "{}")


@pytest.mark.parametrize("content", ["valid", "corrupt", "none"])
def test_read_only_tuning_dir(content):
    """FDPP_TUNING_DIR is a chmod 0555 directory (files 0444), checked by an unprivileged process:
    a valid table is read and used, a corrupt one gives the heuristic with a warning, an absent one
    the heuristic; nothing raises; writing there (the tuner) raises PermissionError."""
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("nobody")
        except KeyError:
            pytest.skip("root, and no user 'nobody' to drop to")
    base = Path(tempfile.mkdtemp(prefix="fdpp-ro-", dir="/tmp"))
    try:
        ro, shipped = base / "tuning", base / "shipped"
        ro.mkdir()
        shipped.mkdir()
        if content == "valid":
            tables.write_table(ro, SM90, [_entry(4096, 3.0)])
        elif content == "corrupt":
            (ro / "NVIDIA_H200.json").write_text("{corrupt")
        for p in (*ro.iterdir(), ro, shipped, base):
            os.chmod(p, 0o555 if p.is_dir() else 0o444)

        def check() -> dict:
            os.environ[tables.ENV_DIR] = str(ro)
            tables.shipped_dir = lambda: shipped
            dispatch.clear_cache()
            p = _problem(4096)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                plan = dispatch.select_plan(p, SM90)
                dispatch.explain(p, SM90)
            try:
                tables.write_table(ro, SM90, [_entry(256, 1.0)])
                wrote = "ok"
            except OSError as e:
                wrote = type(e).__name__
            return {"source": plan.source, "heuristic": plan == default_config(p, SM90),
                    "warnings": [str(x.message) for x in w], "write": wrote}

        res = _in_unprivileged_child(check)
        assert "exception" not in res, res
        assert res["write"] == "PermissionError", res  # really read-only for that process
        if content == "valid":
            assert res["source"] == "table", res
        else:
            assert res["source"] == "heuristic" and res["heuristic"], res
        if content == "corrupt":
            assert any("ignoring tuned table" in m for m in res["warnings"]), res
    finally:
        for p in [base, *base.rglob("*")]:
            with contextlib.suppress(OSError):
                os.chmod(p, 0o755 if p.is_dir() else 0o644)
        shutil.rmtree(base, ignore_errors=True)


def test_tuning_into_an_unwritable_dir_keeps_the_trials(tmp_path):
    """run_tuning into an --out-dir that cannot be written raises the OSError (it does not pretend
    to have written a table); the study keeps the trials, so a rerun into a writable directory
    resumes without measuring again."""
    import fdpp.tune  # noqa: F401 - the CPU bench below

    f = tmp_path / "a-file"
    f.write_text("x")
    storage = tune.open_storage(f"sqlite:///{tmp_path / 'tune.db'}")
    calls = []

    class Bench:
        def __init__(self, problem):
            self.problem = problem

            def measure(plan):
                calls.append(tune.plan_key(plan, problem.seqlen))
                return 10.0 + abs(math.log2(plan.num_splits) - 2)

            self.measure = measure

        def close(self):
            pass

    buckets = [tables.Bucket(HEADS, 256, 1)]
    with pytest.raises(OSError):
        tune.run_tuning(buckets, SM90, Bench, storage=storage, out_dir=f / "tuning", trials=4, rounds=0,
                        progress=False)
    n = len(calls)
    assert n == 4
    run = tune.run_tuning(buckets, SM90, Bench, storage=storage, out_dir=tmp_path / "tuning", trials=4, rounds=0,
                          progress=False)
    assert len(calls) == n and run.table is not None
    assert set(tables.read_table(run.table, SM90).entries) == {buckets[0].key}


@pytest.mark.parametrize("name", ["garbage", "top-level list", "not utf-8", "deeply nested"])
def test_gemm_table_corrupt_gives_the_heuristic(tmp_path, monkeypatch, name):
    from fdpp import gemm

    f = tmp_path / gemm.table_filename(SM90.name)
    f.write_bytes(CORRUPT[name])
    monkeypatch.setattr(tables, "shipped_dir", lambda: tmp_path / "none")
    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path))
    tables.clear_cache()
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            plan = gemm.choose(4, 4096, 4096, SM90, "fp16")
    finally:
        tables.clear_cache()
    assert any(issubclass(x.category, tables.TableWarning) and str(f) in str(x.message) for x in w)
    assert plan == gemm.heuristic_plan(4, 4096, 4096, "fp16", SM90)


def test_numpy_path_unaffected_by_corrupt_tables(tmp_path):
    """The library keeps computing: a decode_attention call with corrupt tables around."""
    import fdpp
    from fdpp.reference import assert_close, attention_reference

    user = tmp_path / "user"
    user.mkdir()
    (user / "NVIDIA_H200.json").write_bytes(CORRUPT["not utf-8"])
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 8, 64)).astype(np.float16)
    k = rng.standard_normal((2, 50, 2, 64)).astype(np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fdpp.decode_attention(q, k, k)
    assert_close(out, attention_reference(q, k, k)[0], "fp16")
