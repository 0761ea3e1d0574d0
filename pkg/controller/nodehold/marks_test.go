package nodehold

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// apply is what a merge patch of the changes makes of annotations.
func apply(annotations map[string]string, ch Changes) map[string]string {
	out := map[string]string{}
	for k, v := range annotations {
		out[k] = v
	}
	for k, v := range ch {
		if v == nil {
			delete(out, k)
		} else {
			out[k] = *v
		}
	}
	return out
}

func TestMarks(t *testing.T) {
	held := &Hold{Allocated: []string{"a/x"}}
	reason := held.Reason()
	const karp, ca = KarpenterDoNotDisrupt, ClusterAutoscalerScaleDownDisabled
	ours := map[string]string{karp: "true", ca: "true", Marker: reason}
	for name, tc := range map[string]struct {
		current map[string]string
		hold    *Hold
		want    map[string]string
		// reasonOnly: the changes only rewrite the reason.
		reasonOnly bool
	}{
		"not held, not marked: nothing": {
			current: map[string]string{"team": "a"}, want: map[string]string{"team": "a"},
		},
		"held: marked for both autoscalers, with the reason": {
			current: map[string]string{"team": "a"}, hold: held,
			want: map[string]string{"team": "a", karp: "true", ca: "true", Marker: reason},
		},
		"held and marked: nothing": {current: ours, hold: held, want: ours},
		"held by other claims now: the reason only": {
			current: map[string]string{karp: "true", ca: "true", Marker: "1 gpu.gpudra.dev claim allocated: a/old"}, hold: held,
			want: ours, reasonOnly: true,
		},
		"released: all of gpudra's marks go, other annotations stay": {
			current: map[string]string{"team": "a", karp: "true", ca: "true", Marker: reason},
			want:    map[string]string{"team": "a"},
		},
		"an administrator's annotation on a node gpudra does not hold stays": {
			current: map[string]string{karp: "true", ca: "true"}, want: map[string]string{karp: "true", ca: "true"},
		},
		"an administrator's annotation on a node gpudra then holds is listed as theirs": {
			current: map[string]string{karp: "true"}, hold: held,
			want: map[string]string{karp: "true", ca: "true", Marker: reason, PreexistingMarker: karp},
		},
		"released: the administrator's annotation stays": {
			current: map[string]string{karp: "true", ca: "true", Marker: reason, PreexistingMarker: karp},
			want:    map[string]string{karp: "true"},
		},
		"both autoscalers' annotations were the administrator's": {
			current: map[string]string{karp: "true", ca: "true"}, hold: held,
			want: map[string]string{karp: "true", ca: "true", Marker: reason, PreexistingMarker: karp + "," + ca},
		},
		"the administrator removed theirs while gpudra holds the node: gpudra's now": {
			current: map[string]string{ca: "true", Marker: reason, PreexistingMarker: karp}, hold: held,
			want: ours,
		},
		"an annotation that is not \"true\" protects nothing: set while held": {
			current: map[string]string{karp: "false"}, hold: held, want: ours,
		},
		"someone removed gpudra's autoscaler annotation while it holds the node: back": {
			current: map[string]string{ca: "true", Marker: reason}, hold: held, want: ours,
		},
	} {
		t.Run(name, func(t *testing.T) {
			ch := Marks(tc.current, tc.hold)
			assert.Equal(t, tc.want, apply(tc.current, ch))
			assert.Equal(t, tc.reasonOnly, ch.ReasonOnly(tc.current), "reason only: %v", ch)
			for k := range ch {
				assert.Contains(t, Keys, k, "only gpudra's keys are written")
			}
		})
	}
}
