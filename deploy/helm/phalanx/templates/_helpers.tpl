{{/*
Names. The base is cut to 40 characters so that "-controller", "-rollout" and a
pod suffix stay within Kubernetes' limits.
*/}}
{{- define "phalanx.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "phalanx.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "phalanx.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "phalanx.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "phalanx.selectorLabels" -}}
app.kubernetes.io/name: {{ include "phalanx.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "phalanx.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
The controllers' journal: "" (SQLite in the controller's state dir) or the etcd://
URL of the chart's etcd (etcd.enabled: every member's client address) or of the
user's (etcd.url). More than one controller needs it.
*/}}
{{- define "phalanx.etcdName" -}}
{{- printf "%s-etcd" (include "phalanx.fullname" .) -}}
{{- end -}}

{{- define "phalanx.journal" -}}
{{- $e := .Values.etcd -}}
{{- if and $e.enabled $e.url -}}
{{- fail (printf "etcd.url must be empty when etcd.enabled is true (the chart runs its own etcd): got %s. Set etcd.enabled=false to use yours, or drop etcd.url" $e.url) -}}
{{- end -}}
{{- if $e.enabled -}}
{{- $name := include "phalanx.etcdName" . -}}
{{- $hosts := list -}}
{{- range $i := until (int $e.replicas) -}}
{{- $hosts = append $hosts (printf "%s-%d.%s.%s.svc:2379" $name $i $name $.Release.Namespace) -}}
{{- end -}}
{{- printf "etcd://%s" (join "," $hosts) -}}
{{- else -}}
{{- $e.url -}}
{{- end -}}
{{- if and (gt (int .Values.controller.replicas) 1) (not (or $e.enabled $e.url)) -}}
{{- fail (printf "controller.replicas must be 1 without an etcd journal: got %d (standbys follow the leader through etcd). Set etcd.enabled=true (the chart runs etcd) or etcd.url=etcd://HOST:2379 (yours)" (int .Values.controller.replicas)) -}}
{{- end -}}
{{- end -}}

{{/*
The controller: one Service name, one host and one URL, used by the controller
(--advertise-host, so that its state dir's url is the one replicas are given) and
by every replica (PHALANX_CONTROLLER). With an etcd journal the controllers are a
StatefulSet: each advertises its pod's name under the headless Service
NAME-peers, and the replicas are given every controller's URL, comma-separated (a
standby names the leader; the client follows it).
*/}}
{{- define "phalanx.controllerName" -}}
{{- printf "%s-controller" (include "phalanx.fullname" .) -}}
{{- end -}}

{{- define "phalanx.controllerPeers" -}}
{{- printf "%s-peers" (include "phalanx.controllerName" .) -}}
{{- end -}}

{{- define "phalanx.controllerHost" -}}
{{- if include "phalanx.journal" . -}}
{{- printf "$(POD_NAME).%s.%s.svc" (include "phalanx.controllerPeers" .) .Release.Namespace -}}
{{- else -}}
{{- printf "%s.%s.svc" (include "phalanx.controllerName" .) .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{- define "phalanx.controllerURL" -}}
{{- $scheme := ternary "https" "http" (ne .Values.controller.tls.secretName "") -}}
{{- $port := int .Values.controller.port -}}
{{- if include "phalanx.journal" . -}}
{{- $name := include "phalanx.controllerName" . -}}
{{- $peers := include "phalanx.controllerPeers" . -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.controller.replicas) -}}
{{- $urls = append $urls (printf "%s://%s-%d.%s.%s.svc:%d" $scheme $name $i $peers $.Release.Namespace $port) -}}
{{- end -}}
{{- join "," $urls -}}
{{- else -}}
{{- printf "%s://%s.%s.svc:%d" $scheme (include "phalanx.controllerName" .) .Release.Namespace $port -}}
{{- end -}}
{{- end -}}

{{- define "phalanx.tokenSecret" -}}
{{- default (printf "%s-token" (include "phalanx.fullname" .)) .Values.token.existingSecret -}}
{{- end -}}

{{/* The job token, from the Secret: the controller and every replica read it the same way. */}}
{{- define "phalanx.tokenEnv" -}}
- name: PHALANX_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "phalanx.tokenSecret" . }}
      key: {{ .Values.token.key }}
{{- end -}}

{{/*
The job config, parsed (JSON of a dict). An empty or malformed TOML fails here, in
one line, rather than in the pods.
*/}}
{{- define "phalanx.jobConfig" -}}
{{- if not (trim .Values.config) -}}
{{- fail "config must hold the job TOML: got none. Pass it with --set-file config=JOB.toml" -}}
{{- end -}}
{{- $cfg := fromToml .Values.config -}}
{{- if hasKey $cfg "Error" -}}
{{- fail (printf "config must be a TOML job config: %s" $cfg.Error) -}}
{{- end -}}
{{- toJson $cfg -}}
{{- end -}}

{{/*
The roles to run, as JSON {ROLE: settings}: the config's [roles.*] (a job without
any has `policy` alone, as phalanx reads it), each with roleDefaults, then
roles.ROLE, merged over. `replicas` defaults to the config's n_init_replicas: the
role's first quorum waits for that many, so an install with fewer pods would never
start the job (an upgrade may scale down to min_replicas, never below).
*/}}
{{- define "phalanx.roles" -}}
{{- $cfg := include "phalanx.jobConfig" . | fromJson -}}
{{- $cfgRoles := default (dict "policy" (dict)) $cfg.roles -}}
{{- range $role, $_ := .Values.roles -}}
{{- if not (hasKey $cfgRoles $role) -}}
{{- fail (printf "roles.%s must be a role of the job config: its roles are %s. Add [roles.%s] to the config or remove roles.%s from the values" $role (keys $cfgRoles | sortAlpha | toJson) $role $role) -}}
{{- end -}}
{{- end -}}
{{- $ranks := int (default 1 (dig "replica" "ranks" 1 $cfg)) -}}
{{- $out := dict -}}
{{- range $role, $rc := $cfgRoles -}}
{{- $r := mergeOverwrite (deepCopy $.Values.roleDefaults) (deepCopy (default (dict) (get $.Values.roles $role))) -}}
{{- $min := int (default 1 (get $rc "min_replicas")) -}}
{{- $init := int (default $min (get $rc "n_init_replicas")) -}}
{{- if eq (toString $r.replicas) "<nil>" -}}
{{- $_ := set $r "replicas" $init -}}
{{- else if lt (int $r.replicas) $min -}}
{{- fail (printf "roles.%s.replicas must be >= the config's roles.%s.min_replicas: got %d, expected >= %d (no step runs with fewer). Raise roles.%s.replicas or lower min_replicas" $role $role (int $r.replicas) $min $role) -}}
{{- else if and $.Release.IsInstall (lt (int $r.replicas) $init) -}}
{{- fail (printf "roles.%s.replicas must be >= the config's roles.%s.n_init_replicas at install: got %d, expected >= %d (the first quorum waits for that many). Raise roles.%s.replicas or lower n_init_replicas" $role $role (int $r.replicas) $init $role) -}}
{{- end -}}
{{- /* A rollout replica is one process; a policy replica spans [replica] ranks. */ -}}
{{- $_ := set $r "nproc" (ternary $ranks 1 (eq $role "policy")) -}}
{{- $_ := set $out $role $r -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}
