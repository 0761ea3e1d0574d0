package prepbench

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

func TestPercentileAndLine(t *testing.T) {
	var prep, unprep []time.Duration
	for i := 1; i <= 100; i++ {
		prep = append(prep, time.Duration(i)*time.Millisecond)
		unprep = append(unprep, time.Duration(i)*100*time.Microsecond)
	}
	assert.Equal(t, 51*time.Millisecond, Percentile(prep, 0.5))
	assert.Equal(t, 99*time.Millisecond, Percentile(prep, 0.99))
	assert.Equal(t, time.Duration(0), Percentile(nil, 0.5))
	r := Result{Prepare: prep, Unprepare: unprep, PeakRSS: 41 << 20}
	assert.Equal(t, "prepare p50=51.00 p90=90.00 p99=99.00 unprepare p50=5.10 p99=9.90 rss=41.0", r.Line())
}
