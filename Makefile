# Each target creates .venv when it is missing and installs the project with the
# pinned constraints (torch stays at 2.13.0: it is installed first, then pinned).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

.PHONY: test demo demo-chaos demo-ft bench lint install

$(STAMP):
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,bench]'
	@# vLLM for [rl.engine] kind = "vllm": without torch and its media packages (see the script).
	$(BIN)/python scripts/install_vllm.py --constraints constraints.txt
	@# The Redis transport tests start their own redis-server; they skip without one.
	@command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& (apt-get install -y -q redis-server >/dev/null 2>&1 \
		    || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q redis-server >/dev/null 2>&1)) \
		|| echo "redis-server not installed (needs root and apt-get): the Redis transport tests will skip"; }
	@# The etcd journal's tests start their own etcd (Debian's etcd-server); they skip without one.
	@command -v etcd >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& (apt-get install -y -q etcd-server >/dev/null 2>&1 \
		    || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q etcd-server >/dev/null 2>&1)) \
		|| echo "etcd-server not installed (needs root and apt-get): the etcd journal tests will skip"; }
	@# The Slurm tests start their own cluster (slurmctld, four slurmd, munged: Debian's
	@# slurm-wlm and munge); they skip without them.
	@command -v slurmctld >/dev/null && command -v munged >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& (apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 \
		    || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q slurm-wlm munge >/dev/null 2>&1)) \
		|| echo "slurm-wlm/munge not installed (needs root and apt-get): the Slurm cluster tests will skip"; }
	@# The multi-host tests make hosts of network namespaces (iproute2) and cut them apart
	@# with nftables; they skip without them (or without root).
	@command -v nft >/dev/null && command -v ip >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& (apt-get install -y -q nftables iproute2 >/dev/null 2>&1 \
		    || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q nftables iproute2 >/dev/null 2>&1)) \
		|| echo "nftables/iproute2 not installed (needs root and apt-get): the multi-host tests will skip"; }
	@# The dashboard's browser test drives Debian's chromium (no browser download); it skips without one.
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& (apt-get install -y -q chromium >/dev/null 2>&1 \
		    || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) \
		|| echo "chromium not installed (needs root and apt-get): the dashboard browser test will skip"; }
	@# [rl.env] sandboxed tools run model-written code under Debian's bubblewrap; the sandbox
	@# tests skip without it (and the tool refuses to run, naming the package).
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& (apt-get install -y -q bubblewrap >/dev/null 2>&1 \
		    || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1)) \
		|| echo "bubblewrap not installed (needs root and apt-get): the sandbox tests will skip"; }
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 3 --dist loadfile --durations=30

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples scripts

demo: $(STAMP)
	$(BIN)/phalanx run examples/sort_grpo.toml

demo-chaos: $(STAMP)
	$(BIN)/phalanx run examples/sort_grpo.toml --chaos kill-every=15

demo-ft: $(STAMP)
	$(BIN)/phalanx run examples/ft_mlp.toml --chaos kill-every=8

bench: $(STAMP)
	$(BIN)/python bench/controller.py --json
