from mint.config.doc import config_markdown

print(config_markdown())
