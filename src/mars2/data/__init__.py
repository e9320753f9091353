"""Problems and their loaders: the one `Problem` type, LiveCodeBench / DeepCoder / HumanEval readers and the bundled toy set."""
