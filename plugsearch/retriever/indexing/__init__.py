"""Building the indexes (`plugsearch-index build`) and adopting indexes built elsewhere (`plugsearch-index
import`)."""
