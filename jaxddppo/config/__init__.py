"""Options: the typed config and its validation (`options`), YAML files, overrides and a run
directory's config (`files`), and the option reference (`reference`).
"""
