package nodehold

import (
	"slices"
	"strings"
)

// The annotations. The autoscalers' keys are theirs: Karpenter skips a node
// whose KarpenterDoNotDisrupt is "true" (its disruption's
// ValidateNodeDisruptable), Cluster Autoscaler one whose
// ClusterAutoscalerScaleDownDisabled is "true". Marker, gpudra's, says why
// gpudra set them; the controller's memory is the API, so a new leader
// knows what the last one set from it. PreexistingMarker lists the
// autoscaler keys that were already "true" when gpudra marked the node:
// someone else's (an administrator's), which gpudra neither set nor
// removes. It is written only when there are any.
const (
	KarpenterDoNotDisrupt              = "karpenter.sh/do-not-disrupt"
	ClusterAutoscalerScaleDownDisabled = "cluster-autoscaler.kubernetes.io/scale-down-disabled"
	Marker                             = "gpudra.dev/do-not-disrupt"
	PreexistingMarker                  = "gpudra.dev/do-not-disrupt-preexisting"
)

// AutoscalerKeys are the autoscalers' annotations gpudra sets to "true".
var AutoscalerKeys = []string{KarpenterDoNotDisrupt, ClusterAutoscalerScaleDownDisabled}

// Keys are every annotation gpudra reads or writes on a node.
var Keys = []string{KarpenterDoNotDisrupt, ClusterAutoscalerScaleDownDisabled, Marker, PreexistingMarker}

// Changes are the annotation changes of one node's merge patch: a key to
// its new value, or to nil to remove it. Empty: nothing to write.
type Changes map[string]*string

// ReasonOnly says whether the changes only rewrite the reason of a node
// gpudra has marked already.
func (c Changes) ReasonOnly(current map[string]string) bool {
	_, marked := current[Marker]
	_, reason := c[Marker]
	return marked && reason && len(c) == 1 && c[Marker] != nil
}

// Marks are the changes that make a node's annotations (current) say what
// hold says: held (hold not nil) or not.
//
// Held: Marker is the hold's reason and each autoscaler key is "true". An
// autoscaler key already "true" on a node gpudra had not marked is someone
// else's: it is left, and listed in PreexistingMarker, so that gpudra
// never removes it; one listed there that is no longer "true" (its owner
// removed it) becomes gpudra's. A key with another value protects nothing
// (both autoscalers look for "true"): gpudra sets it to "true" and, later,
// removes it.
//
// Not held: a node without Marker is not gpudra's and keeps every
// annotation. A node with Marker loses Marker, PreexistingMarker and the
// autoscaler keys not listed in PreexistingMarker.
func Marks(current map[string]string, hold *Hold) Changes {
	_, marked := current[Marker]
	var preexisting []string
	if marked {
		preexisting = parsePreexisting(current[PreexistingMarker])
	}
	ch := Changes{}
	set := func(key, value string) {
		if v, ok := current[key]; !ok || v != value {
			ch[key] = &value
		}
	}
	remove := func(key string) {
		if _, ok := current[key]; ok {
			ch[key] = nil
		}
	}
	if hold == nil {
		if !marked {
			return ch
		}
		for _, k := range AutoscalerKeys {
			if !slices.Contains(preexisting, k) {
				remove(k)
			}
		}
		remove(Marker)
		remove(PreexistingMarker)
		return ch
	}
	var others []string
	for _, k := range AutoscalerKeys {
		// Someone else's: "true" before gpudra marked the node, and
		// still "true".
		if current[k] == "true" && (!marked || slices.Contains(preexisting, k)) {
			others = append(others, k)
			continue
		}
		set(k, "true")
	}
	set(Marker, hold.Reason())
	if len(others) > 0 {
		set(PreexistingMarker, strings.Join(others, ","))
	} else {
		remove(PreexistingMarker)
	}
	return ch
}

func parsePreexisting(v string) []string {
	var keys []string
	for k := range strings.SplitSeq(v, ",") {
		if k = strings.TrimSpace(k); k != "" {
			keys = append(keys, k)
		}
	}
	return keys
}
