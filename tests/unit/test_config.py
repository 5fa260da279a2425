"""Job config: defaults, TOML, dotted overrides, and every refusal names what to fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from phalanx.config import ROLE_NAMES, ConfigError, JobConfig, apply_overrides, load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def write_toml(tmp_path: Path):
    def write(text: str, name: str = "job.toml") -> Path:
        p = tmp_path / name
        p.write_text(text)
        return p

    return write


# -- defaults and TOML ------------------------------------------------------


def test_defaults_are_valid_and_ordered():
    cfg = load_config()
    t = cfg.timeouts
    assert t.collective_s < t.heartbeat_s < t.quorum_s
    assert t.heartbeat_interval_s < t.heartbeat_s
    assert t.suspect_grace_s < t.heartbeat_s
    assert list(cfg.roles) == ["policy"]
    assert cfg.roles["policy"].n_init_replicas >= cfg.roles["policy"].min_replicas
    assert cfg.job.id == "job"
    assert cfg == JobConfig()


def test_toml_is_parsed(write_toml):
    path = write_toml(
        """
        [job]
        id = "demo"
        seed = 7

        [timeouts]
        collective_s = 2.0
        heartbeat_s = 4.0
        quorum_s = 30.0

        [roles.policy]
        min_replicas = 2
        n_init_replicas = 3
        join_timeout_s = 0.5

        [roles.rollout]
        min_replicas = 1
        """
    )
    cfg = load_config(path)
    assert cfg.job.id == "demo"
    assert cfg.job.seed == 7
    assert (cfg.timeouts.collective_s, cfg.timeouts.heartbeat_s) == (2.0, 4.0)
    assert cfg.timeouts.quorum_s == 30.0
    assert cfg.roles["policy"].min_replicas == 2
    assert cfg.roles["policy"].n_init_replicas == 3
    assert cfg.roles["policy"].join_timeout_s == 0.5
    assert cfg.roles["rollout"].n_init_replicas == 1
    # Sections the file does not name keep their defaults.
    assert cfg.controller == JobConfig().controller


def test_load_accepts_str_path(write_toml):
    path = write_toml('[job]\nid = "s"\n')
    assert load_config(str(path)).job.id == "s"


def test_dump_round_trips():
    cfg = load_config(overrides=["roles.rollout.min_replicas=2", "roles.rollout.n_init_replicas=2"])
    assert JobConfig.model_validate(cfg.dump()) == cfg


# -- overrides ----------------------------------------------------------------


def test_override_flag_form():
    cfg = load_config(overrides=["--timeouts.heartbeat_s", "8", "--job.id", "flagged"])
    assert cfg.timeouts.heartbeat_s == 8.0
    assert cfg.job.id == "flagged"


def test_override_flag_form_can_lower_heartbeat_to_five_with_collective():
    cfg = load_config(overrides=["--timeouts.collective_s", "2", "--timeouts.heartbeat_s", "5"])
    assert cfg.timeouts.heartbeat_s == 5.0
    assert cfg.timeouts.collective_s == 2.0


def test_override_equals_form():
    cfg = load_config(overrides=["roles.policy.min_replicas=2", "roles.policy.n_init_replicas=4"])
    assert cfg.roles["policy"].min_replicas == 2
    assert cfg.roles["policy"].n_init_replicas == 4


def test_override_flag_with_equals():
    cfg = load_config(overrides=["--controller.journal_sync=full"])
    assert cfg.controller.journal_sync == "full"


def test_override_beats_toml(write_toml):
    path = write_toml('[job]\nid = "from-file"\nseed = 3\n')
    cfg = load_config(path, ["job.id=from-cli"])
    assert cfg.job.id == "from-cli"
    assert cfg.job.seed == 3


def test_override_creates_section():
    # Naming any role replaces the default role set, exactly as a [roles.*] section would.
    cfg = load_config(overrides=["roles.rollout.min_replicas=1"])
    assert set(cfg.roles) == {"rollout"}
    cfg = load_config(overrides=["roles.rollout.min_replicas=1", "roles.policy.min_replicas=1"])
    assert set(cfg.roles) == {"policy", "rollout"}


def test_override_numeric_string_field():
    # A job id that looks like a number is still a job id: the override reads the
    # field's type (text), it does not make every string field accept numbers.
    assert load_config(overrides=["--job.id", "42"]).job.id == "42"
    from phalanx.config.rl import load_rl_config

    assert load_rl_config(overrides=["--transport.replay", "null"]).transport.replay is None
    assert load_rl_config(overrides=["--transport.replay", "memory"]).transport.replay == "memory"


def test_a_number_for_a_text_field_in_toml_is_refused(write_toml):
    """Issue 20: ``job.id = 5`` became "5"."""
    with pytest.raises(ConfigError, match=r"job\.id: Input should be a valid string"):
        load_config(write_toml("[job]\nid = 5\n"))


@pytest.mark.parametrize(
    ("key", "url", "says"),
    [
        ("checkpoint.url", "ftp://", "must name the ftp host or bucket"),
        ("checkpoint.url", "nosuch://x/y", "scheme 'nosuch' is not a storage"),
        ("checkpoint.url", "gopher://x", "scheme 'gopher' is not a storage"),
        ("checkpoint.url", "http://host/x", "scheme 'http' is not a storage"),
        ("checkpoint.url", "s3:///prefix", "must name the s3 host or bucket"),
        ("rl.transport.rollouts", "gopher://x", "scheme 'gopher' is not a storage"),
        ("rl.transport.weights", "zip://x", "scheme 'zip' is not a storage"),
        ("diloco.url", "nosuch://x", "scheme 'nosuch' is not a storage"),
    ],
)
def test_a_storage_url_whose_scheme_cannot_store_is_refused(key, url, says):
    """Issue 20: only the presence of ``://`` was checked."""
    extra = ["diloco.mode=objectstore"] if key.startswith("diloco") else []
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[f"{key}={url}", *extra])
    assert says in str(e.value) and key in str(e.value)


@pytest.mark.parametrize(
    "url", ["/abs/path", "rel/path", "file:///x", "memory://name", "s3://bucket/prefix"]
)
def test_storage_urls_that_can_store_are_accepted(url):
    assert load_config(overrides=[f"checkpoint.url={url}"]).checkpoint.url == url


def test_a_storage_url_whose_package_is_missing_says_which(monkeypatch):
    import fsspec

    def missing(scheme):
        raise ImportError("Please install gcsfs to access Google Storage")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    with pytest.raises(ConfigError, match="needs a package that is not installed: Please install"):
        load_config(overrides=["checkpoint.url=gs://b/x"])


def test_a_config_file_that_is_not_utf8_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "job.toml"
    bad.write_bytes(b'[job]\nid = "caf\xe9"\n')
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert (
        str(e.value)
        == f"job config {bad} is not UTF-8 text: byte 15 is b'\\xe9'. Save the file as UTF-8."
    )


def test_override_later_wins():
    cfg = load_config(overrides=["job.seed=1", "job.seed=2"])
    assert cfg.job.seed == 2


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["timeouts.heartbeat_s"], "must look like --section.key VALUE or section.key=VALUE"),
        (["--timeouts.heartbeat_s"], "needs a value"),
        (["job.id=x", "job.id.sub=1"], "id is a value, not a section"),
    ],
)
def test_malformed_override_refused(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(overrides=overrides)


def test_apply_overrides_coerces_json_values():
    data = apply_overrides({}, ["a.b=1.5", "a.c=true", "a.d=text", '--a.e=["x"]'])
    assert data == {"a": {"b": 1.5, "c": True, "d": "text", "e": ["x"]}}


# -- refusals -----------------------------------------------------------------


@pytest.mark.parametrize(
    "override", ["timeouts.heartbat_s=5", "job.nmae=x", "roles.policy.min_replica=2", "extra=1"]
)
def test_unknown_key_refused_with_its_name(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert key in str(e.value)
    assert "unknown key" in str(e.value)


def test_unknown_key_in_toml_names_file_and_key(write_toml):
    path = write_toml("[timeouts]\nheartbeat = 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value)
    assert "timeouts.heartbeat" in str(e.value)


@pytest.mark.parametrize(
    ("timeouts", "which", "raise_"),
    [
        ({"collective_s": 10, "heartbeat_s": 10, "quorum_s": 60}, "collective_s", "heartbeat_s"),
        ({"collective_s": 12, "heartbeat_s": 10, "quorum_s": 60}, "collective_s", "heartbeat_s"),
        ({"collective_s": 5, "heartbeat_s": 60, "quorum_s": 60}, "heartbeat_s", "quorum_s"),
        ({"collective_s": 5, "heartbeat_s": 70, "quorum_s": 60}, "heartbeat_s", "quorum_s"),
    ],
)
def test_timeout_ordering_refused_saying_what_to_raise(timeouts, which, raise_):
    overrides = [f"timeouts.{k}={v}" for k, v in timeouts.items()]
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    msg = str(e.value)
    assert f"timeouts.{which} must be < timeouts.{raise_}" in msg
    assert f"Raise {raise_}" in msg


def test_heartbeat_interval_and_grace_below_heartbeat():
    with pytest.raises(
        ConfigError, match=re.escape("heartbeat_interval_s must be < timeouts.heartbeat_s")
    ):
        load_config(overrides=["timeouts.heartbeat_interval_s=10"])
    with pytest.raises(
        ConfigError, match=re.escape("suspect_grace_s must be < timeouts.heartbeat_s")
    ):
        load_config(overrides=["timeouts.suspect_grace_s=10"])


def test_n_init_below_min_refused():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["roles.policy.min_replicas=3", "roles.policy.n_init_replicas=2"])
    msg = str(e.value)
    assert "roles.policy" in msg
    assert "n_init_replicas must be >= min_replicas" in msg
    assert "Raise n_init_replicas to at least 3" in msg


def test_n_init_equal_min_accepted():
    cfg = load_config(overrides=["roles.policy.min_replicas=3", "roles.policy.n_init_replicas=3"])
    assert cfg.roles["policy"].n_init_replicas == 3


def test_unknown_role_refused(write_toml):
    path = write_toml("[roles.critic]\nmin_replicas = 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "critic" in str(e.value)
    assert "roles must be among" in str(e.value)
    for name in ROLE_NAMES:
        assert name in str(e.value)


def test_no_role_refused(write_toml):
    path = write_toml("roles = {}\n")
    with pytest.raises(ConfigError, match="at least one role"):
        load_config(path)


@pytest.mark.parametrize(
    "override", ["roles.policy.min_replicas=0", "timeouts.heartbeat_s=-1", "job.id=a b"]
)
def test_field_constraints(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(overrides=[override])


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="must be an existing TOML file") as e:
        load_config(missing)
    assert str(missing) in str(e.value)


def test_directory_is_not_a_file(tmp_path):
    with pytest.raises(ConfigError, match="must be an existing TOML file"):
        load_config(tmp_path)


def test_invalid_toml(write_toml):
    path = write_toml("[job\nid = 1\n")
    with pytest.raises(ConfigError, match="is not valid TOML") as e:
        load_config(path)
    assert str(path) in str(e.value)
    assert e.value.__cause__ is not None


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


# -- examples -----------------------------------------------------------------


def test_every_example_parses():
    """Every job file shipped under examples/ loads as it is."""
    found = sorted(EXAMPLES.rglob("*.toml")) if EXAMPLES.is_dir() else []
    for path in found:
        cfg = load_config(path)
        assert isinstance(cfg, JobConfig), path
        assert cfg.roles, path
        t = cfg.timeouts
        assert t.collective_s < t.heartbeat_s < t.quorum_s, path


# -- replicas of several ranks ------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["replica.ranks=0"], "replica.ranks"),
        (["replica.ranks=2", "diloco.sync_every=2"], "replica.ranks must be 1 in a DiLoCo job"),
        (["train.d_model=30", "train.n_heads=4"], "train.d_model must divide by train.n_heads"),
    ],
)
def test_sharded_replicas_refuse_what_they_cannot_do_yet(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=overrides)


def test_an_rl_job_may_have_sharded_policy_replicas():
    cfg = load_config(EXAMPLES / "sort_grpo.toml", overrides=["replica.ranks=2"])
    assert cfg.replica.ranks == 2 and cfg.rl is not None


def test_the_hsdp_example_has_replicas_of_two_ranks_and_a_transformer():
    cfg = load_config(EXAMPLES / "ft_hsdp.toml")
    assert cfg.replica.ranks == 2 and cfg.train.model == "transformer"


# -- exact reduction ---------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.exact_reduction=true", "diloco.sync_every=2", "diloco.compression=int8"],
            "train.exact_reduction needs diloco.compression = 'none': got 'int8'",
        ),
        (
            ["train.exact_reduction=true", "diloco.sync_every=2", "diloco.compression=bf16"],
            "train.exact_reduction needs diloco.compression = 'none': got 'bf16'",
        ),
        (
            ["train.exact_reduction=true", "diloco.mode=objectstore", "diloco.url=memory://x"],
            "train.exact_reduction applies to diloco.mode = 'sync' only",
        ),
        (
            [
                "train.exact_reduction=true",
                "train.global_batch_size=70000",
                "train.micro_batch_size=1",
            ],
            "must be at most 65536 micro-batches with train.exact_reduction: got 70000",
        ),
    ],
)
def test_an_exact_reduction_refuses_what_it_cannot_honour_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        load_config(overrides=overrides)
    assert str(e.value).count("\n") <= 2, str(e.value)


def test_an_exact_reductions_default_micro_batch_gives_each_first_rank_one_unit():
    cfg = load_config(
        overrides=[
            "train.exact_reduction=true",
            "train.global_batch_size=25",
            "roles.policy.n_init_replicas=3",
            "replica.ranks=2",
        ]
    )
    assert cfg.exact_micro_batch_size == 5 and cfg.exact_unit == 10  # ceil(25 / 6), x2 ranks
    cfg = load_config(overrides=["train.exact_reduction=true", "train.micro_batch_size=4"])
    assert cfg.exact_micro_batch_size == 4
    assert load_config(overrides=["train.exact_reduction=true", "diloco.sync_every=2"]).diloco


def test_an_rl_exact_reduction_refuses_more_micro_batches_than_its_headroom():
    over = ["--rl.grpo.exact_reduction", "true", "--rl.grpo.prompts_per_step", "65537"]
    over += ["--rl.grpo.group_size", "1", "--rl.grpo.micro_batch_size", "1"]
    with pytest.raises(ConfigError, match="must be at most 65536 micro-batches with grpo"):
        load_config(EXAMPLES / "sort_grpo.toml", overrides=over)
