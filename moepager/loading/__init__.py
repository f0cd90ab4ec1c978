"""Where the checkpoint formats meet the model code: a model built from a checkpoint (`build.py`: open it, place its
experts in an executor, build the architecture's modules around it, fill in the dense weights, apply the CPU kernels),
and a checkpoint made for an architecture's real geometry with random weights (`synth.py`, `moepager make-model`)."""
