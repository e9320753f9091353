# Makes this directory (linked as src/mars2/configs) the package `mars2.configs`, so Hydra finds the
# configs as pkg://mars2.configs from an editable or a wheel install.
