"""CPU accelerations applied to a built model: TorchInductor-compiled decode steps, oneDNN-prepacked and int8
dense projections."""
