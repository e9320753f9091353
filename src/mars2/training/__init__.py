"""Lightning pieces: a module per agent, the team module, the tree-search DataModule and the multi-agent callback."""
