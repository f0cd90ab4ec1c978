"""Expert weights as objects: flat packing, reading from checkpoints, computing, and the source seam."""
