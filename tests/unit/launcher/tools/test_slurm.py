"""launcher/tools/sbatch.py: hostlist expansion, master port, the rendered batch script and k2-submit.

No Slurm is installed or started here: ``sbatch`` / ``scontrol`` are absent or small fake scripts on PATH.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k2.config.load import load_config
from k2.config.validate import SBATCH_OPTIONS_SET
from k2.launcher import submit
from k2.launcher.tools.sbatch import render_sbatch
from k2.launcher.training.preemption import REQUEUE_EXIT_CODE
from k2.parallel.hostlist import expand_hostlist, first_host, master_port
from support import REPO

EXAMPLE = [
    "model=kimi_k2",
    "parallel=k2_256gpu",
    "cluster.nodes=32",
    "run.dir=/shared/runs/k2",
    "submit.python=/shared/envs/k2/bin/python",
    "submit.cpus_per_task=16",
    "submit.cpu_bind=cores",
    "submit.gpu_bind=closest",
    "submit.embedded_corpus=true",
    "submit.dry_run=true",
]
# k2_tiny's schedule plans on one rank; a one-node CPU job may use the embedded corpus
ONE_GPU = ["cluster.nodes=1", "cluster.gpus_per_node=1", "submit.request_gpus=false"]


# --- hostlists ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expr, hosts",
    [
        ("nodeA,nodeB[001,003],nodeC", ["nodeA", "nodeB001", "nodeB003", "nodeC"]),
        ("linux[1,2]", ["linux1", "linux2"]),
        ("gpu[008-010]", ["gpu008", "gpu009", "gpu010"]),
        ("node[01-03]", ["node01", "node02", "node03"]),
        ("rack[0-1]_blade[0-1]", ["rack0_blade0", "rack0_blade1", "rack1_blade0", "rack1_blade1"]),
        ("single", ["single"]),
        ("host-1.example.com", ["host-1.example.com"]),
        ("a,b", ["a", "b"]),
        ("n[1-3,7,09-11]", ["n1", "n2", "n3", "n7", "n09", "n10", "n11"]),  # mixed ranges and single numbers
        ("n[8-10]", ["n8", "n9", "n10"]),  # unpadded range grows in width
        ("x[1-2]y,z[001-002]", ["x1y", "x2y", "z001", "z002"]),  # suffix after brackets; padding widths per group
        ("r[00-01]n[1,3]", ["r00n1", "r00n3", "r01n1", "r01n3"]),
        ("n[5]", ["n5"]),
        ("[1-2]", ["1", "2"]),
        (" a , b[1-2] ", ["a", "b1", "b2"]),
    ],
)
def test_expand_hostlist(expr, hosts):
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize(
    "expr, why",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("a,,b", "empty item"),
        ("a,", "empty item"),
        ("node[1-3", "without"),
        ("node1-3]", "without"),
        ("a[[1]]", "nested"),
        ("n[3-1]", "reversed"),
        ("n[]", "empty"),
        ("n[a-b]", "not N"),
        ("n[1-]", "not N"),
        ("n[1--3]", "not N"),
    ],
)
def test_expand_hostlist_errors(expr, why):
    with pytest.raises(ValueError, match=why) as e:
        expand_hostlist(expr)
    assert repr(expr) in str(e.value)


def _fake_bin(tmp_path: Path, name: str, body: str) -> Path:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    f = d / name
    f.write_text("#!/bin/sh\n" + body + "\n")
    f.chmod(0o755)
    return d


def test_first_host_without_scontrol(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    assert first_host("nodeB[003,001],nodeA") == "nodeB003"


def test_first_host_uses_scontrol_and_falls_back(monkeypatch, tmp_path):
    d = _fake_bin(tmp_path, "scontrol", "echo fromscontrol; echo other")
    monkeypatch.setenv("PATH", str(d))
    assert first_host("n[1-2]") == "fromscontrol"
    _fake_bin(tmp_path, "scontrol", "exit 1")  # a failing scontrol: the parser decides
    assert first_host("n[1-2]") == "n1"


# --- master port ----------------------------------------------------------------------------------------


def test_master_port_range_and_determinism():
    for job in [0, 1, 9999, 10000, 123456, 2**31 - 1, 10**12]:
        p = master_port(job)
        assert 1024 < p < 32768 and p == master_port(job)
    assert master_port(123456) == 20000 + 3456
    assert len({master_port(j) for j in range(10000)}) == 10000
    for bad in (-1, "12", 1.5, True):
        with pytest.raises(ValueError):
            master_port(bad)


def test_module_cli(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no scontrol: the parser answers

    def run(*a):
        return subprocess.run(
            [sys.executable, "-m", "k2.parallel.hostlist", *a],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    r = run("master-port", "123456")
    assert r.returncode == 0 and r.stdout == "23456\n"
    r = run("first-host", "gpu[008-010],x")
    assert r.returncode == 0 and r.stdout == "gpu008\n"
    r = run("first-host", "gpu[2-1]")
    assert r.returncode == 2 and "reversed range" in r.stderr
    assert run("master-port", "-3").returncode == 2
    assert run("bogus").returncode == 2


# --- the rendered script --------------------------------------------------------------------------------


def _sbatch_lines(text: str) -> list[str]:
    return [ln[len("#SBATCH ") :] for ln in text.splitlines() if ln.startswith("#SBATCH ")]


def test_render_sbatch_lines_and_run_dir(tmp_path):
    ov = [
        "parallel=pp2",
        "cluster.nodes=2",
        "cluster.gpus_per_node=4",
        f"run.dir={tmp_path}/r1",
        "submit.time=02:30:00",
        "submit.partition=batch",
        "submit.account=proj7",
        "submit.job_name=k2-test",
        "submit.signal_seconds=300",
        "train.iters=5",
    ]
    text = render_sbatch(load_config(ov), ov)
    lines = _sbatch_lines(text)
    for want in [
        "--nodes=2",
        "--ntasks-per-node=4",
        "--gpus-per-node=4",
        "--requeue",
        "--signal=USR1@300",
        "--time=02:30:00",
        "--job-name=k2-test",
        "--partition=batch",
        "--account=proj7",
        f"--output={tmp_path}/r1/slurm-%j.out",
    ]:
        assert want in lines, (want, lines)
    srun = [ln for ln in text.splitlines() if ln.startswith("srun ")]
    assert len(srun) == 1
    assert (
        "-m k2.launcher.train parallel=pp2 cluster.nodes=2 cluster.gpus_per_node=4 train.iters=5 "
        f"run.dir={tmp_path}/r1 " in srun[0]
    )
    assert "submit." not in srun[0] and "SLURM_JOB_ID" not in srun[0]
    assert text.count("run.dir=") == 3  # header comment, corpus step, srun: one fixed directory
    # requeue logic: status 42 -> scontrol requeue; anything else is the job's status
    assert f"if [[ $rc -eq {REQUEUE_EXIT_CODE} || -f {tmp_path}/r1/requeue ]]" in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | head -n1' in text
    assert 'k2py -m k2.parallel.hostlist first-host "$SLURM_JOB_NODELIST"' in text
    assert "--exclusive" in lines and "--mem=0" in lines  # all of each exclusive node's memory
    assert f"PYTHON={sys.executable}  # submit.python" in text.splitlines()  # stated, not from the environment
    assert "K2_PYTHON" not in text


def test_the_nvlink_segment_k2_plan_placed_by_is_asked_of_slurm(tmp_path):
    """``cluster.segment_nodes`` (k2-plan's placement on NVL72 racks) becomes ``#SBATCH --segment``; left
    null, no such line."""
    ov = ["parallel=pp2", "cluster.nodes=2", "cluster.gpus_per_node=4", f"run.dir={tmp_path}/r"]
    assert not [ln for ln in _sbatch_lines(render_sbatch(load_config(ov), ov)) if ln.startswith("--segment")]
    ov.append("cluster.segment_nodes=2")
    assert "--segment=2" in _sbatch_lines(render_sbatch(load_config(ov), ov))


def test_master_port_in_bash_equals_master_port(tmp_path):
    """The script's shell arithmetic gives k2.parallel.hostlist.master_port's port."""
    line = next(ln for ln in render_sbatch(load_config([]), []).splitlines() if "MASTER_PORT=" in ln)
    for job in (0, 7, 123456, 2**31 - 1):
        r = subprocess.run(
            ["bash", "-c", f"SLURM_JOB_ID={job}; {line}; echo $MASTER_PORT"], capture_output=True, text=True
        )
        assert int(r.stdout) == master_port(job), (job, line)


def test_render_distribution():
    """submit.distribution goes to srun (null: no option, Slurm's block default)."""
    ov = ["parallel=cpu4", "cluster.nodes=2", "cluster.gpus_per_node=2", "submit.request_gpus=false"]
    srun = lambda text: [ln for ln in text.splitlines() if ln.startswith("srun ")][0]  # noqa: E731
    assert "--distribution" not in srun(render_sbatch(load_config(ov), ov))
    ov.append("submit.distribution=cyclic")
    assert srun(render_sbatch(load_config(ov), ov)).startswith(
        "srun --kill-on-bad-exit=1 --cpu-bind=none --distribution=cyclic "
    )


def test_render_defaults_relative_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = render_sbatch(load_config([]), [])
    lines = _sbatch_lines(text)
    assert "--time=24:00:00" in lines and "--signal=USR1@120" in lines and "--job-name=k2" in lines
    assert not any(ln.startswith(("--partition", "--account")) for ln in lines)
    assert f"run.dir={tmp_path}/runs/k2_tiny-single" in text  # resolved interpolation, made absolute


def _run_script(tmp_path: Path, ov: list, srun_status: int) -> tuple[subprocess.CompletedProcess, str]:
    """Render ``ov`` and run the script with fake srun / scontrol / python that log their arguments
    (``submit.python`` names the fake python)."""
    log = tmp_path / "calls.log"
    d = _fake_bin(tmp_path, "srun", f'echo "srun $* OMP=$OMP_NUM_THREADS" >> {log}; exit {srun_status}')
    _fake_bin(tmp_path, "scontrol", f'echo "scontrol $*" >> {log}; [ "$1" = show ] && echo nodeX; exit 0')
    _fake_bin(tmp_path, "python", f'echo "python $*" >> {log}')
    ov = [*ov, f"submit.python={d / 'python'}"]
    env = {
        "PATH": f"{d}:/usr/bin:/bin",
        "K2_WORKDIR": str(tmp_path),
        "SLURM_JOB_ID": "10001",
        "SLURM_JOB_NODELIST": "nodeX",
        "SLURM_JOB_NUM_NODES": "1",
    }
    script = tmp_path / "pretrain.sbatch"
    script.write_text(render_sbatch(load_config(ov), ov))
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    return r, log.read_text()


@pytest.mark.parametrize(
    "status, marker, rc, requeued",
    [
        (0, False, 0, False),
        (REQUEUE_EXIT_CODE, False, 0, True),
        (3, False, 3, False),
        (137, True, 0, True),  # srun killed the last ranks (kill-on-bad-exit) after rank 0 left the marker
    ],
)
def test_script_requeue_convention(tmp_path, status, marker, rc, requeued):
    shutil.which("bash") or pytest.skip("no bash")
    ov = [f"run.dir={tmp_path}/run"]
    if marker:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "requeue").write_text("7\n")
    r, calls = _run_script(tmp_path, ov, status)
    assert r.returncode == rc, r.stderr
    assert ("scontrol requeue 10001" in calls) == requeued
    assert f"-m k2.launcher.train run.dir={tmp_path}/run" in calls
    assert "master nodeX:20001" in r.stdout  # 20000 + 10001 % 10000


def test_script_cpus_binding_and_container(tmp_path):
    """cpus_per_task reaches sbatch, srun (which does not inherit it) and OMP_NUM_THREADS; the bindings and
    the pyxis container reach srun; with a container the corpus step runs in it too."""
    ov = [
        f"run.dir={tmp_path}/run",
        "submit.cpus_per_task=6",
        "submit.cpu_bind=ldoms",
        "submit.gpu_bind=closest",
        "submit.container_image='nvcr.io#nvidia/pytorch:24.10-py3'",  # (Hydra: '#' quoted)
        "submit.container_mounts=[/shared:/shared,/scratch:/scratch:ro]",
    ]
    r, calls = _run_script(tmp_path, ov, 0)
    assert r.returncode == 0, r.stderr
    pyxis = "--container-image=nvcr.io#nvidia/pytorch:24.10-py3 --container-mounts=/shared:/shared,/scratch:/scratch:ro"
    corpus, train = [ln for ln in calls.splitlines() if ln.startswith("srun ")]
    assert corpus.startswith(f"srun --ntasks=1 --nodes=1 {pyxis} ") and "-m k2.launcher.data" in corpus
    assert train.startswith(
        f"srun --kill-on-bad-exit=1 --cpu-bind=ldoms --gpu-bind=closest --cpus-per-task=6 {pyxis} "
    ) and train.endswith(" OMP=6"), train
    assert "--cpus-per-task=6" in _sbatch_lines((tmp_path / "pretrain.sbatch").read_text())


def test_rendered_script_bash_syntax(tmp_path):
    ov = ["cluster.nodes=2", "submit.partition=p", "run.wandb.name='it is $HOME'"]
    f = tmp_path / "s.sbatch"
    text = render_sbatch(load_config(ov), ov)
    f.write_text(text)
    r = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    srun = next(ln for ln in text.splitlines() if ln.startswith("srun "))
    assert "run.wandb.name='it is $HOME'" in shlex.split(srun)  # quoted for the shell, reaches Hydra as is


# --- k2-submit ------------------------------------------------------------------------------------------


def test_checked_in_example_is_fresh(capsys, monkeypatch, tmp_path):
    """slurm/pretrain.sbatch == `k2-submit <EXAMPLE>` (regenerate it with that command when this fails)."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch: a dry run never needs one
    assert submit.main(EXAMPLE) == 0
    out = capsys.readouterr().out
    assert out == (REPO / "slurm" / "pretrain.sbatch").read_text(), (
        "slurm/pretrain.sbatch is stale; regenerate: k2-submit " + " ".join(EXAMPLE) + " > slurm/pretrain.sbatch"
    )
    assert "--nodes=32" in _sbatch_lines(out) and "--ntasks-per-node=8" in _sbatch_lines(out)


def test_dry_run_writes_and_submits_nothing(capsys, monkeypatch, tmp_path):
    d = _fake_bin(tmp_path, "sbatch", f"touch {tmp_path}/submitted; echo 77")
    monkeypatch.setenv("PATH", f"{d}:/usr/bin:/bin")
    assert submit.main([*ONE_GPU, f"run.dir={tmp_path}/run", "submit.dry_run=true"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash\n")
    assert not (tmp_path / "submitted").exists() and not (tmp_path / "run").exists()


def test_submit_calls_sbatch(capsys, monkeypatch, tmp_path):
    d = _fake_bin(tmp_path, "sbatch", f'echo "$PWD $*" > {tmp_path}/args; echo "4242;cluster"')
    monkeypatch.setenv("PATH", f"{d}:/usr/bin:/bin")
    assert submit.main([*ONE_GPU, f"run.dir={tmp_path}/run"]) == 0
    assert capsys.readouterr().out == "4242\n"
    script = tmp_path / "run" / "pretrain.sbatch"
    assert script.exists() and f"run.dir={tmp_path}/run" in script.read_text()
    assert (tmp_path / "args").read_text().split() == [str(REPO), "--parsable", str(script)]


def test_help(capsys):
    assert submit.main(["--help"]) == 0
    assert "submit.dry_run=true" in capsys.readouterr().out


def test_missing_sbatch(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert submit.main([*ONE_GPU, f"run.dir={tmp_path}/run"]) == 1
    assert "sbatch not found" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, named",
    [
        (
            ["model=kimi_k2", "parallel=k2_256gpu", "cluster.nodes=3", "submit.embedded_corpus=true"],
            "parallel.pp",
        ),  # 24 ranks
        (["cluster.nodes=0"], "cluster.nodes"),
        (["cluster.gpus_per_node=8"], "schedule.global_batch_tokens"),  # k2_tiny's batch on 8 ranks
        (["submit.time=tomorrow"], "submit.time"),
        (["submit.signal_seconds=0"], "submit.signal_seconds"),
        (["submit.job_name=a b"], "submit.job_name"),
        (["submit.distribution=plane"], "submit.distribution"),
        (["submit.mem=lots"], "submit.mem"),
        (["submit.cpus_per_task=0"], "submit.cpus_per_task"),
        (["submit.cpu_bind=numa"], "submit.cpu_bind"),
        (["submit.gpu_bind=nearest"], "submit.gpu_bind"),
        (["submit.qos=a b"], "submit.qos"),
        (["submit.extra_args=['mail-type=END']"], "submit.extra_args[0]"),
        (
            ["submit.extra_args=['--comment=x','--mem=10G']"],
            "submit.extra_args[1]='--mem=10G': k2-submit sets --mem itself; use submit.mem",
        ),
        (["submit.extra_args=[--exclusive]"], "every job is exclusive"),
        (["submit.container_mounts=[/a:/b]"], "submit.container_image"),
        (["submit.container_image=img", "submit.container_mounts=['a b']"], "submit.container_mounts[0]"),
        (["submit.request_gpus=true"], "submit.embedded_corpus=true"),  # a GPU job on the embedded corpus
        (["cluster.nodes=2", "cluster.gpus_per_node=1", "submit.request_gpus=false"], "data.path is null"),
        (["launch.rendezvous_timeout_s=0"], "launch.rendezvous_timeout_s"),
        (["submit.bogus=1"], "submit.bogus"),
        (["train.precision=fp8"], "train.precision"),
    ],
)
def test_bad_config_exit_2(capsys, monkeypatch, tmp_path, overrides, named):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert submit.main([*ONE_GPU, *overrides, f"run.dir={tmp_path}/run", "submit.dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k2-submit: error: ") and named in err, err


def test_existing_run_refused(capsys, tmp_path):
    """A run killed before its first save is submitted again (it restarts afresh); a run whose
    checkpoints/latest names a checkpoint that is gone, with none that verifies, is refused."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    assert submit.main([*ONE_GPU, f"run.dir={tmp_path}/run", "submit.dry_run=true"]) == 0
    capsys.readouterr()
    (tmp_path / "run" / "checkpoints" / "latest").write_text("iter_0000004\n")
    assert submit.main([*ONE_GPU, f"run.dir={tmp_path}/run", "submit.dry_run=true"]) == 2
    assert "names iter_0000004, which does not exist" in capsys.readouterr().err


def test_resubmitting_a_run_with_a_checkpoint_renders(capsys, tmp_path):
    """A run dir with a checkpoint is not 'used up': submitting it again continues it (auto-resume)."""
    from support.fake_runs import SINGLE
    from support.fake_runs import fake_checkpoint as _fake_checkpoint

    run_dir = tmp_path / "run"
    (run_dir).mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    _fake_checkpoint(run_dir, 4, [*ONE_GPU, f"run.dir={run_dir}"], {**SINGLE, "world_size": 1})
    assert submit.main([*ONE_GPU, f"run.dir={run_dir}", "submit.dry_run=true"]) == 0
    assert f"run.dir={run_dir}" in capsys.readouterr().out


def test_k2_on_32_nodes_renders_the_cluster_lines(capsys, monkeypatch, tmp_path):
    """K2 on 32 nodes with a real dataset: memory, CPUs, binding, QoS / constraint / reservation, extra
    options and the container in the rendered script; without data.path the same job is refused."""
    from tokenizers import Tokenizer, models

    from support.fake_runs import write_dataset as _write_dataset

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(15)} | {"<|endoftext|>": 15}, unk_token="w0"))
    tok.save(str(tmp_path / "tok.json"))
    _write_dataset(str(tmp_path / "corpus"), [[1, 2, 3, 15]] * 50)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch: a dry run never needs one
    k2 = ["model=kimi_k2", "parallel=k2_256gpu", "cluster.nodes=32", f"run.dir={tmp_path}/run", "submit.dry_run=true"]
    ov = [
        *k2,
        f"data.path={tmp_path / 'corpus'}",
        f"data.tokenizer={tmp_path / 'tok.json'}",
        "submit.cpus_per_task=16",
        "submit.cpu_bind=cores",
        "submit.gpu_bind=closest",
        "submit.qos=high",
        "submit.constraint='h100&ib'",
        "submit.reservation=k2",
        "submit.extra_args=['--mail-type=END']",
        "submit.container_image=/shared/k2.sqsh",
        "submit.container_mounts=[/shared:/shared]",
    ]
    assert submit.main(ov) == 0
    text = capsys.readouterr().out
    lines = _sbatch_lines(text)
    for want in [
        "--nodes=32",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--cpus-per-task=16",
        "--exclusive",
        "--mem=0",
        "--qos=high",
        "--constraint=h100&ib",
        "--reservation=k2",
        "--mail-type=END",
    ]:
        assert want in lines, (want, lines)
    srun = next(ln for ln in text.splitlines() if ln.startswith("srun --kill"))
    assert srun.startswith(
        "srun --kill-on-bad-exit=1 --cpu-bind=cores --gpu-bind=closest --cpus-per-task=16 "
        '--container-image=/shared/k2.sqsh --container-mounts=/shared:/shared "$PYTHON" -m '
    )
    assert "PYTHON=python3  # submit.python" in text  # the container's Python
    assert "export OMP_NUM_THREADS=16" in text and "k2.launcher.data" not in text  # no corpus build
    assert submit.main(k2) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "data.path is null" in err and "32 node(s) x 8 GPUs" in err, err
    assert submit.main([*k2, "submit.mem=1500G", "submit.embedded_corpus=true"]) == 0
    assert "--mem=1500G" in _sbatch_lines(capsys.readouterr().out)


def test_every_sbatch_option_set_is_refused_in_extra_args():
    from k2.config import ConfigError

    for name in SBATCH_OPTIONS_SET:
        with pytest.raises(ConfigError, match=f"k2-submit sets {name} itself"):
            load_config([f"submit.extra_args=['{name}=1']"])


def test_site_setup_is_sourced_and_env_exported_before_anything_runs(tmp_path):
    """submit.setup (module loads, an environment) is sourced first, with set -u off (module scripts read
    unset variables); submit.env is exported after it; srun sees both. A missing file or a bad variable
    name is refused naming the setting."""
    from k2.config import ConfigError
    from k2.launcher.tools.sbatch import check_submittable

    log = tmp_path / "calls.log"
    setup = tmp_path / "site.sh"
    setup.write_text(f'echo "setup $UNSET_BY_SITE" >> {log}\nexport K2_SITE_MODULE=cuda-13\n')
    ov = [
        *ONE_GPU,
        f"run.dir={tmp_path}/run",
        f"submit.setup={setup}",
        "+submit.env.NCCL_SOCKET_IFNAME=ib0",
        "+submit.env.K2_QUOTED='a b;$(x)'",
    ]
    check_submittable(load_config(ov))
    r, calls = _run_script(tmp_path, ov, 0)
    assert r.returncode == 0, r.stderr
    lines = calls.splitlines()
    assert lines[0] == "setup " and any(ln.startswith("srun ") for ln in lines[1:]), calls
    d = tmp_path / "bin"
    (d / "srun").write_text(f'#!/bin/sh\necho "srun $K2_SITE_MODULE $NCCL_SOCKET_IFNAME $K2_QUOTED" >> {log}\n')
    log.write_text("")
    script = tmp_path / "pretrain.sbatch"
    subprocess.run(
        ["bash", str(script)],
        env={
            "PATH": f"{d}:/usr/bin:/bin",
            "K2_WORKDIR": str(tmp_path),
            "SLURM_JOB_ID": "1",
            "SLURM_JOB_NODELIST": "n",
            "SLURM_JOB_NUM_NODES": "1",
        },
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "srun cuda-13 ib0 a b;$(x)" in log.read_text().splitlines(), log.read_text()
    with pytest.raises(ConfigError, match="submit.setup='/nope/site.sh': no such file"):
        check_submittable(load_config([*ONE_GPU, f"run.dir={tmp_path}/run", "submit.setup=/nope/site.sh"]))
    from omegaconf import OmegaConf

    from k2.config.validate import check_submit

    bad = {**OmegaConf.to_container(load_config([]).submit), "env": {"A-B": "x"}}  # (Hydra refuses it already)
    with pytest.raises(ConfigError, match="submit.env.A-B: not an environment variable name"):
        check_submit(OmegaConf.create(bad))


def test_k2_submit_notes_the_defaults_a_new_user_should_check(capsys, monkeypatch, tmp_path):
    """The interpreter written into the script (a path of this machine), no partition / account, the 24 h
    default: each a note on stderr; set explicitly, no note."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert submit.main([*ONE_GPU, f"run.dir={tmp_path}/run", "submit.dry_run=true"]) == 0
    err = capsys.readouterr().err
    assert f"k2-submit: note: the job runs {sys.executable} (the Python running k2-submit): it must exist" in err
    assert "no submit.partition / submit.account: Slurm's default for your user applies" in err
    assert "time limit 24:00:00 (the default submit.time" in err
    assert (
        submit.main(
            [
                *ONE_GPU,
                f"run.dir={tmp_path}/run",
                "submit.dry_run=true",
                "submit.python=/x/python",
                "submit.partition=p",
                "submit.account=a",
                "submit.time=2:00:00",
            ]
        )
        == 0
    )
    assert "note:" not in capsys.readouterr().err
