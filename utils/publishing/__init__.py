"""Publishing: the Hub push with its retries and the model card. Imports training (the merge) and below."""
